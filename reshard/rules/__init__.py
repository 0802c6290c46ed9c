"""What each tensor's kind is: manifests, the kind (loader) registry, and manifests derived from config.json.

The quantized kinds register here, so that a kind recorded anywhere resolves wherever rules are used."""

from reshard.rules import quant as _quant  # noqa: F401  registers the quantized kinds (reshard/rules/quant/)
