"""The pure byte plan: per rank, the tensors, their source byte runs, the exact header and offsets."""
