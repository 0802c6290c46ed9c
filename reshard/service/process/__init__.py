"""Process supervision: this worker's lifecycle, `--workers N`, what killed processes leave behind."""
