"""What each tensor's kind is: manifests, the kind (loader) registry, and manifests derived from config.json."""
