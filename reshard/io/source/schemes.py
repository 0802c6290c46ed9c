"""Which URLs reshard reads and writes: a spec with a scheme it does not know (`ftp://`, `file://`) is
refused in one line, where it would otherwise be taken for a local folder named `ftp:`."""

from __future__ import annotations

import re
from typing import Any

from reshard.errors import CheckpointError
from reshard.io.source.stores import is_url

SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
SUPPORTED = "a local path, s3://, gs://, hf://, http(s):// or the service's http://HOST:PORT/v1/checkpoints/NAME"


def check_scheme(spec: Any) -> None:
    """A `CheckpointError` when `spec` is a URL of a scheme reshard cannot read or write."""
    m = SCHEME.match(spec) if isinstance(spec, str) else None
    if m is not None and not is_url(spec):
        raise CheckpointError(f"{spec}: the URL scheme {m.group(1)}:// is not supported; give {SUPPORTED}")


__all__ = ["check_scheme"]
