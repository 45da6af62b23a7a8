"""Rungs that emulate how other systems collect batches, as policies the production scheduler and
driver already express. Every rung runs on the same seeded draws as the ladder. Sources and
simplifications are in docs/peers.md.

None of the peers pins sandbox CPUs into lanes, so every peer rung runs on shared CPUs; each differs
from the others only in knobs of `PolicyConfig`:
- `areal`: completion order; admission = min(staleness bound, concurrency cap), as AReaL's
  `StalenessManager.get_capacity` computes it: groups in flight + ready ≤ (K + 1)·B (its
  (version + K + 1)·B rule in steady state) and groups in flight ≤ `max_concurrent_rollouts`, set to
  the B + S groups every other rung gets from the workload; all engines update together
  (`max_updating_engines` = engine count); in-flight turns kept across the update (AReaL interrupts
  and resubmits them under the new weights, keeping the partial trajectory; `keep` keeps the
  trajectory too, without the re-prefill);
- `prime-rl`: batches in start order (the orchestrator collects the rollouts it launched for a step),
  async level 2 (S = 2·B, K = 2), all engines update together, in-flight turns kept;
- `pipelinerl`: in-flight updates: every engine loads the new weights together while sequences
  continue (`keep` for `update_s`), completion order, the workload's S and K;
- `slime`: over-sampling (`--over-sampling-batch-size` 2·B as in slime's own example, so S = B),
  completion order, and once B groups are done the rest are aborted and regenerated: a
  stop-the-world update restarts every in-flight trajectory;
- `skyrl`: fully asynchronous, finish-time FIFO (completion order), pause-all during weight sync with
  in-flight requests continued afterwards (all engines at once, `keep`), staleness bounded at
  admission the way AReaL does it, and at most `num_parallel_generation_workers` groups generating
  (one group per worker), set to the workload's B + S. With the mechanisms its documentation names,
  this rung coincides with `areal` in the simulator; both are kept so the table shows each peer;
- `areal (no concurrency cap)`, `skyrl (no concurrency cap)`: the same with the concurrency cap left
  out (or set to its largest useful value, (K + 1)·B), so S = K·B groups beyond B may run at once:
  more sandboxes and memory than the workload's S allows every other rung.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from app.core.config import AdmissionMode, PauseModeName, PolicyConfig
from app.sim.workload import Workload

PeerPolicy = Callable[[Workload], dict[str, Any]]


def _common(workload: Workload) -> dict[str, Any]:
    return {
        "groups_per_batch": workload.batch.groups,
        "group_size": workload.batch.group_size,
        "surplus_groups": workload.policy.surplus_groups,
        "max_staleness": workload.policy.max_staleness,
        "pinned_lanes": False,
        "completion_order": True,
        "rolling_updates": True,
        "max_updating_engines": workload.engines.count,
        "pause_mode": PauseModeName.KEEP,
    }


def _staleness_admission(workload: Workload) -> dict[str, Any]:
    # Live groups (running + waiting for their batch) ≤ (K + 1)·B: AReaL's staleness capacity.
    return {"surplus_groups": workload.policy.max_staleness * workload.batch.groups}


def _capped_admission(workload: Workload) -> dict[str, Any]:
    # min(staleness bound, concurrency cap): running ≤ B + S (the workload's cap on sandboxes and
    # memory, which a ready group no longer holds) and running + ready ≤ (K + 1)·B.
    staleness = _staleness_admission(workload)["surplus_groups"]
    running = min(workload.policy.surplus_groups, staleness)
    return {
        "admission": AdmissionMode.IN_FLIGHT,
        "surplus_groups": running,
        "ready_surplus": staleness - running,
    }


PEERS: dict[str, PeerPolicy] = {
    "areal": _capped_admission,
    "prime-rl": lambda w: {
        "completion_order": False,
        "surplus_groups": 2 * w.batch.groups,
        "max_staleness": 2,
    },
    "pipelinerl": lambda w: {},
    "slime": lambda w: {"surplus_groups": w.batch.groups, "rolling_updates": False},
    "skyrl": _capped_admission,
    "areal (no concurrency cap)": _staleness_admission,
    "skyrl (no concurrency cap)": _staleness_admission,
}


def peer_policy(workload: Workload, name: str) -> PolicyConfig:
    if name not in PEERS:
        raise KeyError(f"no peer rung {name!r}; choose one of {', '.join(PEERS)}")
    return PolicyConfig.model_validate({**_common(workload), **PEERS[name](workload)})
