"""Names of the endpoint-picker protocol (Gateway API Inference Extension), defined once.

The ext_proc edge, the Envoy configuration generator and the tests import these: a typo in one place would
silently route nothing, so no module spells them itself.
"""

from __future__ import annotations

DEST_HEADER = "x-gateway-destination-endpoint"  # the decision: `ip:port` of the chosen worker
LB_NAMESPACE = "envoy.lb"  # dynamic-metadata namespace that carries the decision (and the served endpoint)
SUBSET_NAMESPACE = "envoy.lb.subset_hint"  # metadata namespace of the gateway's subset hint
SUBSET_KEY = "x-gateway-destination-endpoint-subset"  # key of the hint (and the header form of it)
SERVED_KEY = "x-gateway-destination-endpoint-served"  # the endpoint the gateway really served
OBJECTIVE_HEADERS = ("x-gateway-inference-objective", "x-llm-d-inference-objective")
FAIRNESS_HEADER = "x-gateway-inference-fairness-id"
# llm-d's P/D contract (llm-d-inference-scheduler pkg/common/routing/common.go @520af47, PrefillEndpointHeader):
# the prefill worker's `ip:port`, read by the sidecar in front of the decode worker. Set only by the picker.
PREFILLER_HEADER = "x-prefiller-host-port"
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"  # gRPC service (and health name)

# This picker's own names (not GAIE's): the booking id it puts next to the decision in `envoy.lb` metadata,
# which its lean-mode signals (first chunk, access log) carry back; the Lua filter's metadata namespace.
BOOKING_KEY = "x-epp-booking-id"
USAGE_NAMESPACE = "epp.usage"
