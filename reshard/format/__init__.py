"""Safetensors files and checkpoints: headers, validated checkpoints, selections, rank-file self-description."""
