"""Where a stream's bytes come from: opening a source (local, store, HTTP, rank files), its readers and their fetch-ahead."""
