"""How commpress names a failed collective: one wording for every error a rank raises.

``where`` names the operation (collective, bucket or module, step, rank), :func:`failure` turns
whatever a collective raised into one clean ``RuntimeError`` / :class:`CollectiveTimeout` that
ends with what to do, and names the dead, stopped or silent peers (:mod:`.heartbeat`).
"""

from __future__ import annotations

import re

from .heartbeat import HEARTBEAT

__all__ = ["CollectiveTimeout", "advice", "clean_message", "failure", "round_failure", "timeout_error", "where",
           "PEER_SETTLE_S"]


class CollectiveTimeout(RuntimeError):
    """A collective did not complete within the timeout: a peer is stuck, dead or far behind."""


ADVICE = ("the process group cannot be used any more: stop training on every rank and restart "
          "from the last checkpoint (torchrun --max-restarts restarts the job); if the peer was "
          "only slow, raise init_process_group(timeout=...) or register(..., timeout=...)")


def advice() -> str:
    """What to do after a failed or timed-out collective (the tail of every such error)."""
    return ADVICE


_WRAPPERS = re.compile(r"^(?:Unable to cast\s*)?(?:Got the following error when running the callback:\s*)?"
                       r"(?:[A-Za-z_.]*(?:Error|Exception|Timeout):\s*)?")


def clean_message(exc: BaseException) -> str:
    """The message of ``exc`` without torch's callback wrapping and traceback tail."""
    msg = str(exc)
    prev = None
    while prev != msg:
        prev = msg
        msg = _WRAPPERS.sub("", msg, count=1).strip()
    msg = msg.split("\n\nAt:\n")[0]
    msg = re.sub(r"\s*to Tensor$", "", msg)
    # gloo's source location and its boilerplate advice (commpress gives its own)
    msg = re.sub(r"\[[^\]\s]*\.(?:cc|cpp|h):\d+\]\s*", "", msg)
    msg = re.sub(r"\s*This is typically caused by .*?(?:GLHF!\s*\S*|$)", "", msg, flags=re.S)
    return msg.strip()


def failure(what: str, exc: BaseException) -> BaseException:
    """One clean error for a failed collective, for DDP/FSDP to raise from ``backward()``.

    A commpress error (message starting ``commpress:``, possibly buried in torch's callback
    wrapping) is passed on with its own wording (the first failure names the collective);
    anything else becomes ``"<what> failed: <reason> (<the dead or silent peers>)"``. Both end
    with what to do."""
    if isinstance(exc, (ValueError, TypeError)) and str(exc).startswith("commpress:"):
        return exc  # a configuration error: its own advice
    msg = clean_message(exc)
    if not msg.startswith("commpress:"):
        # a lost connection names its peer by address only: tell which rank is dead or silent
        lost = any(k in msg for k in _PEER_LOSS)
        msg = f"{what} failed: {msg}{_peers_hint(PEER_SETTLE_S if lost else 0.0)}"
    if ADVICE not in msg:
        msg = f"{msg}; {ADVICE}"
    timed_out = isinstance(exc, CollectiveTimeout) or "did not complete within" in msg
    return CollectiveTimeout(msg) if timed_out else RuntimeError(msg)


#: how a transport says its peer went away (gloo, NCCL, MPI)
_PEER_LOSS = ("Connection reset", "Connection closed", "Broken pipe", "Connection refused",
              "remote process exited")
#: seconds a failure waits for the heartbeats to tell which peer went silent (only when no
#: peer on this host is seen dead or stopped at once)
PEER_SETTLE_S = 2.5


def round_failure(what: str, exc: BaseException) -> BaseException:
    """The error a caller gets when an algorithm failed in its own thread: an intermediate
    round, or the decode of what a broken round handed back."""
    if clean_message(exc).startswith("commpress:"):
        return failure(what, exc)  # our own wording (a timed-out round, a corrupt table)
    return failure(what, RuntimeError(
        f"{clean_message(exc)} (when a peer died or disconnected, gloo can hand back garbage "
        "instead of an error, and decoding it fails like this)"))


def timeout_error(what: str, seconds: float) -> CollectiveTimeout:
    return CollectiveTimeout(
        f"{what} did not complete within {seconds:g} s: a peer rank is stuck (stopped, hung, "
        f"deadlocked), dead, or far behind{_peers_hint(1.5)}; {ADVICE}")


def _peers_hint(settle: float = 0.0) -> str:
    peers = HEARTBEAT.silent(settle)
    return f" ({peers})" if peers else ""



def _rank(comm) -> str:
    """``"rank R of W"`` in the default group; a sub-group's collective (hierarchical tiers, a
    mesh dimension) also says its rank there, so every rank's error names the same numbering."""
    text = f"rank {comm.rank} of {comm.world_size}"
    if getattr(comm, "group", None) is None:
        return text
    try:
        import torch.distributed as dist

        g, gw = dist.get_rank(), dist.get_world_size()
    except Exception:  # noqa: BLE001 - no default group: the sub-group's numbering only
        return text
    if (g, gw) == (comm.rank, comm.world_size):
        return text
    return f"rank {g} of {gw} ({text} in its sub-group)"


def where(comm, what: str, bucket: int, numel: int, dtype, step: int, unit: str | None = None) -> str:
    """``"commpress: <what> of bucket B (N x dtype) at step S on rank R of W"``; ``unit``
    names what ``bucket`` indexes otherwise (FSDP: ``"module 'layers.0'"``)."""
    return (f"commpress: {what} of {unit or f'bucket {bucket}'} ({numel} x "
            f"{str(dtype).replace('torch.', '')}) at step {step} on {_rank(comm)}")
