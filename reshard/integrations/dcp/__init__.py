"""torch DCP's side: `ReshardReader`, a `torch.distributed.checkpoint.StorageReader` answered by boxes
(`reshard.integrations.dcp.reader`). Importing this imports torch."""

from reshard.integrations.dcp.reader import ReshardReader

__all__ = ["ReshardReader"]
