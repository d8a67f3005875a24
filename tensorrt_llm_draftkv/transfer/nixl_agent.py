"""The NIXL transfer agent (UCX backend): one-sided WRITEs with a notification, polled to completion.

The engine is optional: `nixl_unavailable()` says why it cannot be used (None
when it can), and nothing here imports it before an agent is built.
"""
from __future__ import annotations

import importlib
import os
import time
from types import ModuleType
from typing import Any

from .agent import (BaseTransferAgent, MemoryDescs, TransferError, TransferRequest, TransferStatus,
                    TransferTimeout)

#: UCX on the loopback interface only: tcp carries the messages (an shm-only list fails at agent
#: creation), cma moves the bytes between two processes of one host.
LOOPBACK_ENV = {"UCX_NET_DEVICES": "lo", "UCX_TLS": "tcp,cma,self", "NIXL_LOG_LEVEL": "WARN"}

_MODULES = ("nixl._api", "nixl_cu12._api")  # the meta package's name, then the CUDA 12 wheel's
_POLL_MAX_S = 1e-3  # back off to at most 1 ms between polls: the peer may share the core


def load_nixl() -> ModuleType:
    """NIXL's Python API module; `ImportError` listing what was tried when no wheel imports."""
    errors = []
    for name in _MODULES:
        try:
            return importlib.import_module(name)
        except ImportError as err:  # a wheel with missing native libraries raises ImportError too
            errors.append(f"{name}: {err}")
    raise ImportError("NIXL cannot be imported (" + "; ".join(errors) + "); install it with "
                      "pip install nixl-cu12==1.5.1")


def nixl_unavailable() -> str | None:
    """Why NIXL cannot be used here (the import error), or None when it imports."""
    try:
        load_nixl()
    except ImportError as err:
        return str(err)
    return None


def use_loopback() -> None:
    """Keep UCX on the loopback interface (unless the environment already chose); call before an agent exists."""
    for key, value in LOOPBACK_ENV.items():
        os.environ.setdefault(key, value)


def _poll(done, timeout_s: float | None, what: str) -> None:
    """Call `done()` until it is true, sleeping 10 us doubling to 1 ms; `TransferTimeout` after `timeout_s`."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    pause = 1e-5
    while not done():
        if deadline is not None and time.monotonic() > deadline:
            raise TransferTimeout(f"{what}: not done after {timeout_s:g} s")
        time.sleep(pause)
        pause = min(2 * pause, _POLL_MAX_S)


class NixlTransferStatus(TransferStatus):
    """A posted NIXL transfer (`check_xfer_state`: DONE, PROC or ERR)."""

    def __init__(self, agent: Any, handle: Any, what: str) -> None:
        self._agent, self._handle, self._what = agent, handle, what

    def is_completed(self) -> bool:
        state = self._agent.check_xfer_state(self._handle)
        if state == "ERR":
            self._release()
            raise TransferError(f"{self._what}: the engine reports the transfer failed")
        return state == "DONE"

    def wait(self, timeout_s: float | None = None) -> None:
        try:
            _poll(self.is_completed, timeout_s, self._what)
        finally:
            self._release()

    def _release(self) -> None:
        if self._handle is not None:
            handle, self._handle = self._handle, None
            try:
                self._agent.release_xfer_handle(handle)
            except Exception:  # noqa: BLE001 - a handle the engine already dropped (a failed transfer)
                pass


class NixlTransferAgent(BaseTransferAgent):
    """A NIXL agent with the UCX backend, behind the package's transfer-agent interface."""

    def __init__(self, name: str, *, backends: tuple[str, ...] = ("UCX",), progress_thread: bool = False) -> None:
        """`progress_thread`: NIXL's own progress thread; off by default because it polls, taking a core
        from the workers on a small host; this agent's waits drive progress themselves."""
        api = load_nixl()
        self.name = name
        config = api.nixl_agent_config(enable_prog_thread=progress_thread, backends=list(backends))
        self._agent = api.nixl_agent(name, config)
        self._remotes: dict[str, str] = {}  # our name for a peer -> the engine's
        self._early: list[bytes] = []  # sync messages that arrived before anyone waited for them

    def register_memory(self, descs: MemoryDescs) -> None:
        if len(descs):
            self._agent.register_memory(descs.descs, descs.type)

    def deregister_memory(self, descs: MemoryDescs) -> None:
        if len(descs):
            self._agent.deregister_memory(self._agent.get_reg_descs(descs.descs, descs.type))

    def get_local_agent_desc(self) -> bytes:
        return self._agent.get_agent_metadata()

    def load_remote_agent(self, name: str, agent_desc: bytes) -> None:
        engine_name = self._agent.add_remote_agent(agent_desc)
        self._remotes[name] = engine_name.decode() if isinstance(engine_name, bytes) else engine_name

    def invalidate_remote_agent(self, name: str) -> None:
        engine_name = self._remotes.pop(name, None)
        if engine_name is not None:
            self._agent.remove_remote_agent(engine_name)

    def submit_transfer_requests(self, request: TransferRequest) -> TransferStatus:
        what = f"transfer {request.sync_message.decode(errors='replace')} to {request.remote_name}"
        if request.remote_name not in self._remotes:
            raise TransferError(f"{what}: no agent descriptor loaded for {request.remote_name}")
        try:
            local = self._agent.get_xfer_descs(request.src_descs.descs, request.src_descs.type)
            remote = self._agent.get_xfer_descs(request.dst_descs.descs, request.dst_descs.type)
            handle = self._agent.initialize_xfer(request.op, local, remote, self._remotes[request.remote_name],
                                                 request.sync_message)
        except Exception as err:  # the engine's own error types (nixlNotFoundError, ...): unregistered memory
            raise TransferError(f"{what}: the engine refused it ({type(err).__name__}: {err})") from err
        status = NixlTransferStatus(self._agent, handle, what)
        if self._agent.transfer(handle) == "ERR":
            status.wait(0)  # releases the handle, raises TransferError
        return status

    def wait_sync_message(self, message: bytes, timeout_s: float) -> None:
        def arrived() -> bool:
            for msgs in self._agent.get_new_notifs().values():
                self._early.extend(msgs)
            if message in self._early:
                self._early.remove(message)
                return True
            return False

        _poll(arrived, timeout_s, f"sync message {message.decode(errors='replace')}")

    def close(self) -> None:
        for name in list(self._remotes):
            self.invalidate_remote_agent(name)
