"""One router per resource: health, checkpoints, shards, jobs, metrics."""
