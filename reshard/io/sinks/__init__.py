"""Where rank files go: atomic files and reshard.json, stores, the merge back to an HF checkpoint."""
