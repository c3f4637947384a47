"""Expert parallelism's collectives and their failures: one collective at a time through
:meth:`CollectiveGroup._collective`, which turns a dead or silent peer into a :class:`ParallelError` naming the rank
when it can be found (:meth:`CollectiveGroup._missing_ranks`, on the rendezvous store), never a hang. A part of
:class:`moestream.parallel.ExpertParallel`.
"""

from __future__ import annotations

import datetime
import time

import torch

from .errors import MoestreamError


class ParallelError(MoestreamError):
    """A collective failed: a rank died, stopped answering, or the ranks diverged."""


class CollectiveGroup:
    """The collectives of :class:`~moestream.parallel.ExpertParallel` (which holds the state: ``rank``, ``world``,
    ``device``, ``timeout_s``, ``failed``), with a failed or silent peer named."""

    @staticmethod
    def _dist():
        import torch.distributed as dist

        return dist

    def _collective(self, fn, what: str):
        """Run one collective; turn a dead or silent peer into a :class:`ParallelError`."""
        try:
            return fn()
        except ParallelError:
            raise
        except Exception as e:  # gloo: RuntimeError on a reset connection or at the timeout; NCCL: DistBackendError
            self.failed = True
            who = self._missing_ranks()
            name = (f"rank {', '.join(map(str, who))}" if who else
                    f"rank {1 - self.rank}" if self.world == 2 else "another rank")
            msg = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
            raise ParallelError(
                f"expert parallel: {name} stopped answering during {what} (rank {self.rank} of {self.world} "
                f"waited at most {self.timeout_s:g} s): {msg}"
            ) from None

    def _missing_ranks(self) -> list[int]:
        """Ranks that do not check in on the rendezvous store within 2 s (best effort: [] when
        the store itself is gone)."""
        try:
            from torch.distributed import distributed_c10d as c10d

            store = c10d._get_default_store()
            store.set_timeout(datetime.timedelta(seconds=2))
            store.set(f"moestream/alive/{self.rank}", "1")
            time.sleep(1.0)
            return [r for r in range(self.world) if r != self.rank and not store.check([f"moestream/alive/{r}"])]
        except Exception:
            return []

    def close(self) -> None:
        """Leave the process group (when this module started it)."""
        import torch.distributed as dist

        if getattr(self, "_owns_group", False) and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # a dead peer: nothing left to tear down cleanly
                pass


def all_gather_single(out: torch.Tensor, t: torch.Tensor) -> None:
    """``all_gather_single`` (torch >= 2.13), else its older name ``all_gather_into_tensor``."""
    import torch.distributed as dist

    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, t)
