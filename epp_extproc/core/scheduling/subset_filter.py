"""The gateway's subset hint (GAIE `x-gateway-destination-endpoint-subset`): the picker may narrow it, never
widen it. Always part of every profile (the protocol obliges it, so no config file can leave it out); it keeps
the order of the addresses it is given."""

from __future__ import annotations

from collections.abc import Sequence

from epp_extproc.core.scheduling.table import SchedulingRequest


class SubsetFilter:
    name = "subset-filter"

    def filter(self, req: SchedulingRequest, addresses: Sequence[str] | None) -> Sequence[str]:
        subset = req.ctx.subset
        if addresses is None:
            raise ValueError("the subset filter narrows a role filter's answer; it cannot start a profile")
        if subset is None:
            return addresses
        allowed = set(subset)
        return [a for a in addresses if a in allowed]
