"""Other engines' entry points into reshard: each subpackage is imported only when its engine is installed
(`reshard.integrations.vllm`: a vLLM model-loader plugin, load_format="reshard")."""
