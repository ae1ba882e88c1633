"""Scheduling policies: which waiting request is admitted next, and which running one is preempted.

A policy is one ordering used both ways, so admission and preemption can never disagree: the scheduler
admits the waiting request with the smallest `rank` and, when the KV pool runs dry, preempts the
running request with the largest. Policies see requests, never blocks or the engine.

- `fifo`: arrival order (preempts the newest arrival).
- `priority`: higher `priority` first, FIFO among equals.
- `sjf`: shortest estimated job first (uncached prompt + max_tokens still to compute), with aging:
  every second of waiting takes `aging_tokens_per_second` off the estimate, so a long job is
  eventually admitted however many short ones keep arriving.
- `wfq`: weighted fair queuing across tenants by token cost. Each tenant has a virtual counter of the
  tokens it was served divided by its weight (the prompt tokens it computes, not those the prefix
  cache served, charged at first admission; one token per generated token); the tenant with the
  smallest counter goes next. A tenant that comes back from idle starts at the smallest counter among
  backlogged tenants, so it cannot bank credit while away, and a tenant that floods the queue only
  advances its own counter: it cannot starve another. Its state is bounded by the live requests plus
  `max_idle_tenants` (see the class).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Mapping
from typing import ClassVar

from base.errors import ConfigError
from decode_service.engine_core.request import ServedRequest

Rank = tuple[float, ...]


class SchedulingPolicy(ABC):
    """Orders requests; smaller rank = more urgent. Stateless policies only implement `rank`."""

    name: ClassVar[str]

    @abstractmethod
    def rank(self, request: ServedRequest, now: float) -> Rank:
        """The request's place in line at time `now` (monotonic seconds)."""

    def on_enqueued(self, request: ServedRequest) -> None:
        """A new request entered the system (not called again when a preempted one is requeued)."""
        return

    def on_admitted(self, request: ServedRequest) -> None:
        """The request got its prompt blocks and starts prefill (also after each preemption)."""
        return

    def on_token_generated(self, request: ServedRequest) -> None:
        """The request received one more generated token."""
        return

    def on_finished(self, request: ServedRequest) -> None:
        """The request left the system (finished, aborted or failed)."""
        return


class FifoPolicy(SchedulingPolicy):
    name = "fifo"

    def rank(self, request: ServedRequest, now: float) -> Rank:
        return (request.arrival_index,)


class PriorityPolicy(SchedulingPolicy):
    name = "priority"

    def rank(self, request: ServedRequest, now: float) -> Rank:
        return (-request.priority, request.arrival_index)


class ShortestJobFirstPolicy(SchedulingPolicy):
    name = "sjf"

    def __init__(self, aging_tokens_per_second: float = 100.0) -> None:
        if aging_tokens_per_second < 0:
            raise ConfigError(f"SJF aging must be >= 0 tokens/s, got {aging_tokens_per_second}")
        self.aging_tokens_per_second = aging_tokens_per_second

    def rank(self, request: ServedRequest, now: float) -> Rank:
        waited = max(0.0, now - request.arrival_time)
        estimate = request.estimated_remaining_tokens - self.aging_tokens_per_second * waited
        return (estimate, request.arrival_index)


class WeightedFairQueuingPolicy(SchedulingPolicy):
    """WFQ whose state is bounded by live requests, not by every tenant name ever seen.

    Counters are kept for tenants with a live request. A tenant whose last request ends keeps its
    counter only while it is ahead of the floor (the smallest live counter), because returning would
    otherwise wipe its lead; at or below the floor it would restart at the floor anyway, so it is
    forgotten. At most `max_idle_tenants` leads are kept (the smallest are forgotten first), and all
    of them go when no tenant is live: with nobody waiting there is no one to be fair to.
    """

    name = "wfq"

    def __init__(
        self,
        tenant_weights: Mapping[str, float] | None = None,
        default_weight: float = 1.0,
        max_idle_tenants: int = 1024,
    ) -> None:
        weights = dict(tenant_weights or {})
        for tenant, weight in [*weights.items(), ("<default>", default_weight)]:
            if not weight > 0:
                raise ConfigError(f"tenant weight must be > 0, got {tenant}={weight}")
        if max_idle_tenants < 0:
            raise ConfigError(f"max_idle_tenants must be >= 0, got {max_idle_tenants}")
        self.tenant_weights = weights
        self.default_weight = default_weight
        self.max_idle_tenants = max_idle_tenants
        # Counters of tenants with live requests, and the leads of idle tenants still ahead of the floor.
        self.virtual_tokens: dict[str, float] = {}
        self.idle_leads: dict[str, float] = {}
        self._live = Counter[str]()

    def weight(self, tenant: str) -> float:
        return self.tenant_weights.get(tenant, self.default_weight)

    def rank(self, request: ServedRequest, now: float) -> Rank:
        return (self.virtual_tokens.get(request.tenant, 0.0), request.arrival_index)

    def _floor(self) -> float:
        return min(self.virtual_tokens.values(), default=0.0)

    def on_enqueued(self, request: ServedRequest) -> None:
        tenant = request.tenant
        if self._live[tenant] == 0:
            floor = self._floor()
            self.virtual_tokens[tenant] = max(self.idle_leads.pop(tenant, floor), floor)
        self._live[tenant] += 1

    def on_admitted(self, request: ServedRequest) -> None:
        # Only the first admission is charged: recomputing after a preemption is the server's cost.
        if request.num_preemptions == 0:
            self._charge(request.tenant, request.seq.num_prompt_tokens - request.seq.num_cached_tokens)

    def on_token_generated(self, request: ServedRequest) -> None:
        self._charge(request.tenant, 1)

    def on_finished(self, request: ServedRequest) -> None:
        tenant = request.tenant
        self._live[tenant] -= 1
        if self._live[tenant] > 0:
            return
        del self._live[tenant]
        counter = self.virtual_tokens.pop(tenant)
        if not self.virtual_tokens:
            self.idle_leads.clear()
            return
        floor = self._floor()
        if counter > floor:
            self.idle_leads[tenant] = counter
        if len(self.idle_leads) > self.max_idle_tenants:
            ahead = sorted((lead, t) for t, lead in self.idle_leads.items() if lead > floor)
            self.idle_leads = {t: lead for lead, t in ahead[len(ahead) - self.max_idle_tenants :]}

    def _charge(self, tenant: str, num_tokens: int) -> None:
        self.virtual_tokens[tenant] += num_tokens / self.weight(tenant)


POLICY_NAMES = ("fifo", "priority", "sjf", "wfq")


def make_policy(
    name: str,
    tenant_weights: Mapping[str, float] | None = None,
    sjf_aging_tokens_per_second: float = 100.0,
    max_idle_tenants: int = 1024,
) -> SchedulingPolicy:
    """Build the policy named in the server config."""
    if name == "fifo":
        return FifoPolicy()
    if name == "priority":
        return PriorityPolicy()
    if name == "sjf":
        return ShortestJobFirstPolicy(sjf_aging_tokens_per_second)
    if name == "wfq":
        return WeightedFairQueuingPolicy(tenant_weights, max_idle_tenants=max_idle_tenants)
    raise ConfigError(f"policy must be one of {', '.join(POLICY_NAMES)}, not {name!r}")
