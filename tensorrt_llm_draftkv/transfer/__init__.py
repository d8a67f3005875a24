"""KV transfer between disaggregated ranks: the transfer-agent interface, registered memory, descriptors,
and two agents (NIXL over UCX; the torch.distributed wire). Never imports the simulator."""
from .agent import (BaseTransferAgent, MemoryDescs, MemoryType, PeerGone, TransferError, TransferOp,
                    TransferRequest, TransferStatus, TransferTimeout)
from .descriptors import page_runs, page_write_descs, slot_descs
from .nixl_agent import LOOPBACK_ENV, NixlTransferAgent, load_nixl, nixl_unavailable, use_loopback
from .regions import PoolRegion, RankMemory, layer_region, pool_regions
from .rendezvous import Rendezvous
from .torch_wire_agent import TorchWireAgent

__all__ = [
    "BaseTransferAgent", "MemoryDescs", "MemoryType", "PeerGone", "TransferError", "TransferOp",
    "TransferRequest", "TransferStatus", "TransferTimeout", "page_runs", "page_write_descs", "slot_descs",
    "LOOPBACK_ENV", "NixlTransferAgent", "load_nixl", "nixl_unavailable", "use_loopback", "PoolRegion",
    "RankMemory", "layer_region", "pool_regions", "Rendezvous", "TorchWireAgent",
]
