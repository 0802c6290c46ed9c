"""The service as a client sees it: its URLs, a rank's body read into the caller's memory, pulls."""
