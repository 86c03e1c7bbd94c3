"""One config file: an llm-d `EndpointPickerConfig` compiled into a plain `SchedulingSpec` of our plugin types.

llm-d users already describe scheduling in one YAML file (`--config-file` of llm-d's EPP): plugins by type and
name, scheduling profiles that reference them with weights, and a few top-level sections. This module reads
that shape so the file moves over unchanged, and compiles it into *our* plugin types, with a report that says
which entry mapped to what, which was ignored and why, and which warnings the mapping carries. It builds no
plugin: the result is plain frozen data the Director wires up (and tests compare), so importing this module
imports nothing heavy (PyYAML is imported only when a text is parsed or written).

Read against llm-d-router at commit ebab687927f5331c1b39defcb579a07951bce56c (2026-08-22):
`apix/config/v1alpha1/endpointpickerconfig_types.go` (the schema and its top-level sections),
`pkg/epp/config/loader/{configloader,defaults,validation}.go` (name defaults to type; duplicate names, missing
types, unknown types, undefined `pluginRef`s and unknown feature gates are errors; a scorer's weight defaults to
1; a profile without a picker gets the first picker plugin, else a new `max-score-picker`; one profile and no
handler means `single-profile-handler`; no profiles means one `default` profile of every filter, scorer and
picker; the deprecated `inference.networking.x-k8s.io/v1alpha1` group is accepted with a deprecation line),
`cmd/epp/runner/runner.go` `registerInTreePlugins` (the registry: `LLMD_KNOWN`) and the parameter structs of
the plugins we map (`pkg/epp/framework/plugins/...`; the KV-events and token-processor structs are
llm-d-kv-cache v0.9.0's `pkg/kvevents/pool.go` and `pkg/kvcache/kvblock/token_processor.go`). Where llm-d
iterates a Go map (which picker fills a profile that names none) we take file order, so the result is
deterministic.

Scoring: llm-d sums weighted scorers, each normalised to [0, 1] over the candidates. We compile its prefix and
load scorers into ONE `kv-block-cost-scorer` (our cost prices a cached block against a queued block in one
unit, blocks); their weights cannot be kept and each dropped weight is named in a warning note. The README
("One config file") says why.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

API_VERSION = "llm-d.ai/v1alpha1"
DEPRECATED_API_VERSION = "inference.networking.x-k8s.io/v1alpha1"
KIND = "EndpointPickerConfig"
MAX_FILE_BYTES = 1 << 20  # a config is a few KiB; a larger file is a mistake (or a log), not a config
LLMD_COMMIT = "ebab687927f5331c1b39defcb579a07951bce56c"


# ---------------------------------------------------------------------------------------------------- outputs


@dataclass(frozen=True)
class PluginSpec:
    """One plugin instance: `type` is our canonical type, `parameters` our (camelCase) names with defaults
    filled; `source_type` is the type the file wrote (an llm-d type, several joined by `,` when scorers were
    folded into one), kept so start-up and `/debug/score` can say where a plugin came from."""

    type: str
    name: str
    parameters: Mapping[str, Any]
    source_type: str


@dataclass(frozen=True)
class ProfileSpec:
    """One scheduling profile: filters in order, scorers with their weights, exactly one picker."""

    name: str
    filters: tuple[PluginSpec, ...]
    scorers: tuple[tuple[PluginSpec, float], ...]
    picker: PluginSpec


@dataclass(frozen=True)
class Note:
    """One line of the start-up report: what an entry of the file became (`mapped`), why it was dropped
    (`ignored`), or what the mapping changed that the user should know (`warning`)."""

    entry: str
    status: Literal["mapped", "ignored", "warning"]
    detail: str


@dataclass(frozen=True)
class SchedulingSpec:
    """What a config file (or today's flags) means to the scheduler: the profile handler, the profiles by
    name, `settings` (Config field name -> value: what the file sets that is a flag today, e.g.
    `kv_cache_block_size`, `flow_control`) and the report. `notes` do not take part in equality: two
    specs that schedule the same are equal however they were written."""

    handler: PluginSpec
    profiles: Mapping[str, ProfileSpec]
    settings: Mapping[str, Any]
    notes: tuple[Note, ...] = field(default=(), compare=False)


class ConfigFileError(ValueError):
    """The file cannot be compiled; the message names the entry (plugin name / profile name) and the field."""


# ------------------------------------------------------------------------------------------- our plugin types

Kind = Literal["handler", "filter", "scorer", "picker"]


@dataclass(frozen=True)
class _Param:
    """One parameter of one of our types: a check that returns the value (or raises with what it expected)
    and the default (`_REQUIRED` = none)."""

    check: Callable[[Any], Any]
    default: Any


_REQUIRED = object()
_ABSENT = object()  # an optional parameter without a default: left out of the checked parameters when not given


def _int_at_least(low: int) -> Callable[[Any], int]:
    def check(v: Any) -> int:
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise _Bad(f"an integer >= {low}")
        return v
    return check


def _float_check(low: float, strict: bool) -> Callable[[Any], float]:
    def check(v: Any) -> float:
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        if not ok or (v <= low if strict else v < low):
            raise _Bad(f"a number {'>' if strict else '>='} {low:g}")
        return float(v)
    return check


def _choice(values: tuple[str, ...]) -> Callable[[Any], str]:
    def check(v: Any) -> str:
        if v not in values:
            raise _Bad(f"one of {', '.join(values)}")
        return str(v)
    return check


class _Bad(Exception):
    """A parameter check's complaint: what was expected (the caller adds the entry, field and value)."""


@dataclass(frozen=True)
class _Type:
    kind: Kind
    params: Mapping[str, _Param]
    doc: str


OUR_TYPES: Mapping[str, _Type] = MappingProxyType({
    "single-profile-handler": _Type("handler", {}, "one profile for every request"),
    "pd-profile-handler": _Type("handler", {"threshold": _Param(_int_at_least(0), 16)},
                                "profiles `decode` and `prefill`: a prompt with at least `threshold` uncached "
                                "tokens on the chosen decode worker is prefilled on a prefill worker (0 = never)"),
    "decode-filter": _Type("filter", {}, "workers that decode (role label decode / both / unset)"),
    "prefill-filter": _Type("filter", {}, "workers that prefill (role label prefill / both)"),
    "kv-block-cost-scorer": _Type("scorer", {
        "overlapCredit": _Param(_float_check(0.0, strict=False), 2.0),
        "prefillLoadScale": _Param(_float_check(0.0, strict=False), 8.0),
    }, "Dynamo's KV-router cost in blocks: prefill load minus credited cached blocks, plus decode load (lower "
       "is better)"),
    "eviction-scorer": _Type("scorer", {}, "prices what a long prompt would evict, and credits a cached prefix "
                                         "only as far as it will likely survive"),
    "predicted-time-scorer": _Type("scorer", {
        "overlapCredit": _Param(_float_check(0.0, strict=False), 2.0),
        "prefillLoadScale": _Param(_float_check(0.0, strict=False), 8.0),
    }, "each worker's predicted TTFT (+ TPOT term), in seconds; the features are the block cost's terms"),
    "min-cost-picker": _Type("picker", {}, "the lowest cost, random among exact ties"),
    "softmax-picker": _Type("picker", {"temperature": _Param(_float_check(0.0, strict=True), _REQUIRED)},
                            "samples from a softmax over range-normalised costs"),
    "bounded-load-picker": _Type("picker", {
        "bound": _Param(_float_check(0.0, strict=True), _REQUIRED),
        "temperature": _Param(_float_check(0.0, strict=False), 0.0),
        "rule": _Param(_choice(("weighed", "longest")), "weighed"),
        "tieredBound": _Param(_float_check(0.0, strict=True), _ABSENT),
    }, "the cached prefix first among workers whose load is within (1 + bound) x the average: `weighed` lowers "
       "each one's cost by (1 + bound) x the average load x the share of the prompt it holds; `longest` lets "
       "the longest prefix win; `tieredBound`: the bound instead while any worker holds blocks off the GPU "
       "(host memory, disk, shared storage; the flags' default with tier credit: 2.0)"),
    "random-picker": _Type("picker", {}, "uniform over the candidates"),
    "tiered-credit": _Type("scorer", {
        "gpuWeight": _Param(_float_check(0.0, strict=False), 1.0),
        "hostWeight": _Param(_float_check(0.0, strict=False), 0.8),
        "diskWeight": _Param(_float_check(0.0, strict=False), 0.25),
        "sharedWeight": _Param(_float_check(0.0, strict=False), 0.25),
        "unknownWeight": _Param(_float_check(0.0, strict=False), 0.25),
    }, "credits a cached prefix block by block at the best tier holding each block (GPU, host memory, disk, "
       "shared storage; issue 44): adds to the credited overlap every pricing plugin reads; place it after "
       "eviction-scorer"),
})


@dataclass(frozen=True)
class Rule:
    """Two plugin types that cannot share a profile, and why (the error names both entries)."""

    a: str
    b: str
    why: str


# Combinations refused at start-up. The Director's plugins add theirs here: one line each.
RULES: tuple[Rule, ...] = (
    Rule("kv-block-cost-scorer", "predicted-time-scorer",
         "their costs are in different units (KV blocks vs seconds) and cannot be added"),
    Rule("eviction-scorer", "predicted-time-scorer",
         "the flush penalty is in KV blocks and the time cost in seconds: they cannot be added"),
    Rule("tiered-credit", "predicted-time-scorer",
         "tiered credit adds to the credited overlap, which the time cost does not read"),
)


# ------------------------------------------------------------------------------------------ llm-d's plugin types

# llm-d scorers whose meaning our block cost already covers: prefix credit and load in one formula.
FOLDED_SCORERS: frozenset[str] = frozenset({
    "prefix-cache-scorer", "precise-prefix-cache-scorer", "queue-scorer", "kv-cache-utilization-scorer",
    "load-aware-scorer", "active-request-scorer",
})

# Every other type llm-d registers (runner.go registerInTreePlugins at LLMD_COMMIT, plus the few older names
# its samples still use), by kind, with why it is not mapped. Known = reported as ignored, never an error.
_NO_ENCODE = "we have no encode (multimodal encoder) stage"
_MULTI = "no multi-cluster pools"
_SYNC = "replicas share state over replica sync (--peers, --processes)"
_ORDER = "our flow control's order is fixed: priority bands, round robin between fairness ids, FIFO within one"
_NO_USAGE = "no usage-limit policy"
_NO_EVICT = "no eviction of running requests"
_DCGM = "no GPU (DCGM) metrics"
_RENDER = "we render prompts ourselves: --tokenizer-protocol and --tokenizer-service-url"
_OPENAI = "we parse the OpenAI API ourselves; no parser plugins"
LLMD_KNOWN: Mapping[str, tuple[str, str]] = MappingProxyType({
    # filters
    "encode-filter": ("filter", _NO_ENCODE),
    "label-selector-filter": ("filter", "no label-selector filter: select workers with --inference-pool-name's "
                                        "selector or --endpoints"),
    "by-label-selector": ("filter", "no label-selector filter (deprecated llm-d alias of label-selector-filter)"),
    "by-label": ("filter", "no label filter (deprecated llm-d alias of label-selector-filter)"),
    "session-affinity-filter": ("filter", "session affinity is --session-affinity-keys-file (sealed tokens)"),
    "multicluster-session-affinity-filter": ("filter", _MULTI),
    "endpoint-attribute-filter": ("filter", "no endpoint-attribute filter"),
    "topology-affinity-filter": ("filter", "no topology data"),
    "utilization-filter": ("filter", "saturation is flow control's (--flow-control, --queue-depth-threshold)"),
    "prefix-cache-affinity-filter": ("filter", "the bounded-load-picker gives cached prefixes priority instead"),
    "slo-headroom-tier-filter": ("filter", "SLOs are the predicted-time-scorer's (--cost-model time)"),
    "header-based-testing-filter": ("filter", "llm-d's conformance-test filter"),
    # scorers
    "lora-affinity-scorer": ("scorer", "no LoRA-affinity scorer: an adapter's requests are scored by that "
                                      "adapter's own KV blocks"),
    "session-affinity-scorer": ("scorer", "session affinity is --session-affinity-keys-file (sealed tokens)"),
    "running-requests-size-scorer": ("scorer", "load is in the kv-block-cost-scorer, counted in blocks"),
    "token-load-scorer": ("scorer", "load is in the kv-block-cost-scorer, counted in blocks"),
    "no-hit-lru-scorer": ("scorer", "no cold-request spreading scorer: the block cost spreads by load"),
    "context-length-aware": ("scorer", "no context-length scorer"),
    "mm-embeddings-cache-scorer": ("scorer", _NO_ENCODE),
    "header-label-affinity-scorer": ("scorer", "no header-label affinity"),
    "endpoint-attribute-scorer": ("scorer", "no endpoint-attribute scorer"),
    "topology-affinity-scorer": ("scorer", "no topology data"),
    "latency-scorer": ("scorer", "predicted latency is the predicted-time-scorer (--cost-model time)"),
    "multicluster-queue-scorer": ("scorer", _MULTI),
    "multicluster-kv-cache-utilization-scorer": ("scorer", _MULTI),
    "multicluster-prefix-cache-scorer": ("scorer", _MULTI),
    # pickers
    "weighted-random-picker": ("picker", "no score-proportional sampling: use softmax-picker"),
    # profile handlers and deciders
    "data-parallel-profile-handler": ("handler", "data-parallel ranks are one worker: `kv_ranks` on the endpoint"),
    "header-profile-handler": ("handler", "no header-chosen profiles"),
    "disagg-headers-handler": ("other", "we name the prefill worker in x-prefiller-host-port ourselves"),
    "prefill-header-handler": ("other", "we name the prefill worker in x-prefiller-host-port ourselves"),
    "always-disagg-multimodal-decider": ("decider", _NO_ENCODE),
    # data producers
    "inflight-load-producer": ("producer", "we book load ourselves (LoadTracker)"),
    "predicted-latency-producer": ("producer", "the time cost learns online (--cost-model time)"),
    "mm-embeddings-cache-producer": ("producer", _NO_ENCODE),
    "session-id-producer": ("producer", "session affinity is --session-affinity-keys-file"),
    "burst-prefix-cache-producer": ("producer", "our KV index is fed by the workers' KV events"),
    "p2p-source-producer": ("producer", "no peer-to-peer KV source"),
    "multicluster-approx-prefix-cache-producer": ("producer", _MULTI),
    "token-producer": ("producer", _RENDER),
    "tokenizer": ("producer", _RENDER),
    # request control
    "latency-slo-admitter": ("admitter", "SLO admission is the time cost's (x-slo-ttft-ms, sheddable -> 429)"),
    "probabilistic-admitter": ("admitter", "admission is flow control's (--flow-control)"),
    "request-attribute-reporter": ("other", "no request-attribute reporter"),
    "agent-identity": ("other", "no agent-identity header processor"),
    "disaggregatedset-rollout-screener": ("other", "no rollout screener"),
    "destination-endpoint-served-verifier": ("other", "llm-d's conformance-test plugin"),
    # data layer
    "metrics-data-source": ("datalayer", ""),  # mapped: see _MAPPED_AS_FEATURE
    "core-metrics-extractor": ("datalayer", ""),
    "models-data-source": ("datalayer", "models come from the request and --model-rewrites-file"),
    "models-data-extractor": ("datalayer", "models come from the request and --model-rewrites-file"),
    "endpoint-notification-source": ("datalayer", "workers come from --endpoints, --endpoints-file or "
                                                  "--inference-pool-name"),
    "k8s-notification-source": ("datalayer", "workers come from --inference-pool-name"),
    "topology-extractor": ("datalayer", "no topology data"),
    "dcgm-data-source": ("datalayer", _DCGM),
    "dcgm-extractor": ("datalayer", _DCGM),
    "multicluster-metrics-data-source": ("datalayer", _MULTI),
    "multicluster-metrics-extractor": ("datalayer", _MULTI),
    "file-discovery": ("discovery", "file discovery is --endpoints-file"),
    "multicluster-file-discovery": ("discovery", _MULTI),
    "cross-replica-publisher": ("datalayer", _SYNC),
    "local-syncer": ("datalayer", _SYNC),
    # flow control policies and saturation detectors
    "global-strict-fairness-policy": ("flowcontrol", _ORDER),
    "round-robin-fairness-policy": ("flowcontrol", _ORDER),
    "program-aware-fairness": ("flowcontrol", _ORDER),
    "fcfs-ordering-policy": ("flowcontrol", _ORDER),
    "edf-ordering-policy": ("flowcontrol", _ORDER),
    "slo-deadline-ordering-policy": ("flowcontrol", _ORDER),
    "static-usage-limit-policy": ("flowcontrol", _NO_USAGE),
    "priority-holdback-policy": ("flowcontrol", _NO_USAGE),
    "soft-reflective-ceiling-policy": ("flowcontrol", _NO_USAGE),
    "sheddable-eviction-filter": ("flowcontrol", _NO_EVICT),
    "priority-then-time-eviction-order-policy": ("flowcontrol", _NO_EVICT),
    "concurrency-detector": ("detector", "saturation is --queue-depth-threshold / --kv-cache-util-threshold / "
                                         "--max-num-batched-tokens"),
    # request parsers
    "openai-parser": ("parser", _OPENAI),
    "anthropic-parser": ("parser", "no Anthropic API parsing"),
    "vllmhttp-parser": ("parser", _OPENAI),
    "vllmgrpc-parser": ("parser", "no vLLM gRPC parsing"),
    "sglanghttp-parser": ("parser", _OPENAI),
    "vertexai-parser": ("parser", "no Vertex AI parsing"),
    "passthrough-parser": ("parser", _OPENAI),
})

# llm-d types we map: their kind and every parameter llm-d's struct accepts (llm-d decodes strictly, so an
# unknown one is an error there too). Deprecated/older names llm-d's earlier samples used are accepted.
_PRODUCER_PARAMS = frozenset({"tokenProcessorConfig", "indexerConfig", "kvEventsConfig", "speculativeIndexing",
                              "speculativeTTL"})
_APPROX_PARAMS = frozenset({"autoTune", "blockSizeTokens", "blockSize", "maxPrefixBlocksToMatch",
                            "maxPrefixTokensToMatch", "lruCapacityPerServer"})
LLMD_MAPPED: Mapping[str, tuple[str, frozenset[str]]] = MappingProxyType({
    "disagg-profile-handler": ("handler", frozenset({
        "stageOrder", "profiles", "deciders", "decodeProfile", "prefillProfile", "encodeProfile",
        "prefillDeciderPluginName", "encodeDeciderPluginName", "deciderPluginName"})),
    "prefix-based-pd-decider": ("decider", frozenset({"nonCachedTokens", "promptTokens"})),
    "always-disagg-pd-decider": ("decider", frozenset()),
    "prefix-cache-scorer": ("scorer", frozenset({"prefixMatchInfoProducerName", "matchLengthWeight",
                                                 "matchLengthScaleTokens"}) | _APPROX_PARAMS),
    "precise-prefix-cache-scorer": ("scorer", _PRODUCER_PARAMS),
    "queue-scorer": ("scorer", frozenset()),
    "kv-cache-utilization-scorer": ("scorer", frozenset()),
    "load-aware-scorer": ("scorer", frozenset({"threshold"})),
    "active-request-scorer": ("scorer", frozenset({"requestTimeout", "idleThreshold"})),
    "max-score-picker": ("picker", frozenset({"maxNumOfEndpoints"})),
    "precise-prefix-cache-producer": ("producer", _PRODUCER_PARAMS),
    "approx-prefix-cache-producer": ("producer", _APPROX_PARAMS),
    "utilization-detector": ("detector", frozenset({"queueDepthThreshold", "kvCacheUtilThreshold",
                                                    "metricsStalenessThreshold", "headroom"})),
})
# llm-d's own parameters on types that share our name (ours are checked strictly, these are known extras).
_LLMD_EXTRA_PARAMS: Mapping[str, frozenset[str]] = MappingProxyType({
    "pd-profile-handler": frozenset({"decodeProfile", "prefillProfile", "prefixPluginType", "prefixPluginName",
                                     "primaryPort", "deciderPluginName", "prefixMatchInfoProducerName",
                                     "hashBlockSize"}),
    "random-picker": frozenset({"maxNumOfEndpoints"}),
})
# Data-layer plugins whose job one of our own components does: mapped, with no setting.
_MAPPED_AS_FEATURE: Mapping[str, str] = MappingProxyType({
    "metrics-data-source": "our worker-metrics scraper (--worker-metrics-interval-ms, --worker-metrics-path)",
    "core-metrics-extractor": "our worker-metrics scraper reads queue, running and KV utilisation",
})
_PICKER_ALIASES = {"max-score-picker": "min-cost-picker"}

# featureGates llm-d registers (flowControl, haPopulateNonLeaderDatastore at LLMD_COMMIT; dataLayer and
# enableLegacyMetrics in earlier releases whose files still carry them).
FEATURE_GATES: Mapping[str, str] = MappingProxyType({
    "flowControl": "",
    "haPopulateNonLeaderDatastore": "no leader election: every replica serves and watches the pool",
    "dataLayer": "the data layer is always on (llm-d made it the default too)",
    "enableLegacyMetrics": "we scrape worker metrics ourselves (--worker-metrics-interval-ms)",
})

TOP_LEVEL = ("apiVersion", "kind", "featureGates", "plugins", "schedulingProfiles", "dataLayer", "flowControl",
             "requestHandler", "saturationDetector", "parser")


# ------------------------------------------------------------------------------------------------- helpers


def _fail(entry: str, what: str) -> ConfigFileError:
    return ConfigFileError(f"{entry}: {what}")


def _show(v: Any) -> str:
    return repr(v) if isinstance(v, str) else str(v)


def _mapping(v: Any, entry: str) -> Mapping[str, Any]:
    if v is None:
        return {}
    if not isinstance(v, Mapping):
        raise _fail(entry, f"must be a mapping, got {type(v).__name__}")
    return v


def _list(v: Any, entry: str) -> list[Any]:
    if v is None:
        return []
    if not isinstance(v, list):
        raise _fail(entry, f"must be a list, got {type(v).__name__}")
    return v


def _str(v: Any, entry: str) -> str:
    if not isinstance(v, str) or not v:
        raise _fail(entry, f"must be a non-empty string, got {_show(v)}")
    return v


_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def _duration_s(v: Any, entry: str) -> float:
    """A Go/Kubernetes duration (`30s`, `1m30s`, `500ms`) in seconds, as llm-d's metav1.Duration reads it."""
    if isinstance(v, str):
        pos, total = 0, 0.0
        for m in _DURATION.finditer(v):
            if m.start() != pos:
                break
            total += float(m.group(1)) * _UNIT_S[m.group(2)]
            pos = m.end()
        if v and pos == len(v):
            return total
    raise _fail(entry, f"must be a duration such as '30s' or '500ms', got {_show(v)}")


def _go_duration(seconds: float) -> str:
    return f"{int(seconds)}s" if float(seconds).is_integer() else f"{round(seconds * 1000, 6):g}ms"


_QUANTITY = re.compile(r"(\d+)(k|M|G|T|Ki|Mi|Gi|Ti)?")
_SUFFIX = {None: 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30,
           "Ti": 2**40}


def _quantity(v: Any, entry: str) -> int:
    """A Kubernetes resource quantity as llm-d's flowControl limits take it (`100`, `1k`, `1Ki`)."""
    if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
        return v
    m = _QUANTITY.fullmatch(v) if isinstance(v, str) else None
    if m is None:
        raise _fail(entry, f"must be a quantity such as 100 or '1k', got {_show(v)}")
    return int(m.group(1)) * _SUFFIX[m.group(2)]


def _check_ours(type_: str, name: str, params: Mapping[str, Any], extra: frozenset[str] = frozenset()
                ) -> dict[str, Any]:
    """Our type's parameters, checked and with defaults filled; `extra` = llm-d's names that may also appear
    (left for the caller to map or report)."""
    spec = OUR_TYPES[type_]
    for k in params:
        if k not in spec.params and k not in extra:
            known = ", ".join(sorted(spec.params) + sorted(extra)) or "none"
            raise _fail(f"plugins[{name}].parameters.{k}", f"unknown parameter of {type_} (known: {known})")
    out: dict[str, Any] = {}
    for k, p in spec.params.items():
        if k in params:
            try:
                out[k] = p.check(params[k])
            except _Bad as e:
                raise _fail(f"plugins[{name}].parameters.{k}", f"must be {e}, got {_show(params[k])}") from None
        elif p.default is _REQUIRED:
            raise _fail(f"plugins[{name}].parameters.{k}", f"required by {type_}")
        elif p.default is not _ABSENT:
            out[k] = p.default
    return out


def _plugin(type_: str, name: str, params: Mapping[str, Any], source: str) -> PluginSpec:
    return PluginSpec(type_, name, MappingProxyType(dict(params)), source)


# --------------------------------------------------------------------------------------------------- parser


@dataclass
class _Entry:
    """One `plugins` entry as the file wrote it, plus its kind once classified."""

    name: str
    type: str
    params: Mapping[str, Any]
    kind: str  # handler / filter / scorer / picker / decider / producer / detector / ... / "ignored-<kind>"


class _Compiler:
    """One pass over one document; collects notes and settings as it goes."""

    def __init__(self, doc: Mapping[str, Any]) -> None:
        self.doc = doc
        self.notes: list[Note] = []
        self.settings: dict[str, Any] = {}
        self.entries: dict[str, _Entry] = {}
        self.referenced: set[str] = set()  # plugin names some compiled profile uses
        self.produced: set[str] = set()  # entries whose producer settings were read (read each once)
        self.detectors: set[str] = set()  # the saturation detector's entry name
        self.compiled: dict[str, PluginSpec] = {}  # filter/scorer/picker entries compiled so far, by name

    def note(self, entry: str, status: Literal["mapped", "ignored", "warning"], detail: str) -> None:
        self.notes.append(Note(entry, status, detail))

    def set(self, key: str, value: Any, entry: str, how: str) -> None:
        self.settings[key] = value
        self.note(entry, "mapped", f"{how} -> setting {key} = {_show(value)}")

    # --- top level

    def compile(self) -> SchedulingSpec:
        doc = self.doc
        for k in doc:
            if k not in TOP_LEVEL:
                raise _fail(str(k), f"unknown top-level field of {KIND} (known: {', '.join(TOP_LEVEL)})")
        api = doc.get("apiVersion")
        if api == DEPRECATED_API_VERSION:
            self.note("apiVersion", "warning", f"{DEPRECATED_API_VERSION} is deprecated; use {API_VERSION} "
                                               "(llm-d accepts both, as we do)")
        elif api != API_VERSION:
            raise _fail("apiVersion", f"must be {API_VERSION} (or the deprecated {DEPRECATED_API_VERSION}), "
                                      f"got {_show(api)}")
        if doc.get("kind") != KIND:
            raise _fail("kind", f"must be {KIND}, got {_show(doc.get('kind'))}")
        self._read_plugins(_list(doc.get("plugins"), "plugins"))
        gates = self._feature_gates(_list(doc.get("featureGates"), "featureGates"))
        handler, profiles = self._scheduling()
        self._flow_control(gates)
        self._data_layer()
        self._request_handler()
        self._unreferenced()
        return SchedulingSpec(handler, MappingProxyType(profiles), MappingProxyType(dict(self.settings)),
                              tuple(self.notes))

    # --- plugins

    def _read_plugins(self, raw: list[Any]) -> None:
        for i, item in enumerate(raw):
            m = _mapping(item, f"plugins[{i}]")
            for k in m:
                if k not in ("type", "name", "parameters"):
                    raise _fail(f"plugins[{i}].{k}", "unknown field (known: type, name, parameters)")
            name_raw = m.get("name")
            if "type" not in m or not m.get("type"):
                raise _fail(f"plugins[{name_raw or i}].type", "missing (every plugin names its type)")
            type_ = _str(m["type"], f"plugins[{name_raw or i}].type")
            name = _str(name_raw, f"plugins[{i}].name") if name_raw is not None else type_
            if name in self.entries:
                raise _fail(f"plugins[{name}].name", "duplicate plugin name (a second entry needs its own name)")
            params = _mapping(m.get("parameters"), f"plugins[{name}].parameters")
            self.entries[name] = _Entry(name, type_, params, self._classify(name, type_, params))

    def _classify(self, name: str, type_: str, params: Mapping[str, Any]) -> str:
        if type_ in OUR_TYPES:  # checked here too, so an entry no profile uses cannot hide a typo
            _check_ours(type_, name, params, _LLMD_EXTRA_PARAMS.get(type_, frozenset()))
            return OUR_TYPES[type_].kind
        if type_ in LLMD_MAPPED:
            kind, allowed = LLMD_MAPPED[type_]
            for k in params:
                if k not in allowed:
                    raise _fail(f"plugins[{name}].parameters.{k}",
                                f"unknown parameter of llm-d's {type_} (known: {', '.join(sorted(allowed)) or 'none'})")
            return kind
        if type_ in LLMD_KNOWN:
            kind, why = LLMD_KNOWN[type_]
            if type_ in _MAPPED_AS_FEATURE:
                return kind
            self.note(f"plugins[{name}]", "ignored", f"llm-d's {type_}: {why}")
            return "ignored-" + kind
        raise _fail(f"plugins[{name}].type",
                    f"unknown plugin type {type_!r}: neither ours ({', '.join(OUR_TYPES)}) nor one llm-d registers")

    # --- feature gates

    def _feature_gates(self, raw: list[Any]) -> dict[str, bool]:
        gates: dict[str, bool] = {}
        for g in raw:
            text = _str(g, "featureGates")
            name, _, value = text.partition("=")
            entry = f"featureGates[{name}]"
            if name not in FEATURE_GATES:
                raise _fail(entry, f"unknown feature gate (known: {', '.join(FEATURE_GATES)})")
            on = True
            if value:
                v = value.strip().lower()
                if v not in ("true", "false", "1", "0", "t", "f"):
                    raise _fail(entry, f"{value!r} is not a boolean")
                on = v in ("true", "1", "t")
            gates[name] = on
            if name == "flowControl":
                self.set("flow_control", on, entry, "flowControl gate")
            else:
                self.note(entry, "ignored", FEATURE_GATES[name])
        return gates

    # --- scheduling

    def _scheduling(self) -> tuple[PluginSpec, dict[str, ProfileSpec]]:
        raw = _list(self.doc.get("schedulingProfiles"), "schedulingProfiles")
        declared: dict[str, list[tuple[str, Any]]] = {}
        for i, item in enumerate(raw):
            m = _mapping(item, f"schedulingProfiles[{i}]")
            for k in m:
                if k not in ("name", "plugins"):
                    raise _fail(f"schedulingProfiles[{m.get('name', i)}].{k}", "unknown field (known: name, plugins)")
            if not m.get("name"):
                raise _fail(f"schedulingProfiles[{i}].name", "missing")
            pname = _str(m["name"], f"schedulingProfiles[{i}].name")
            if pname in declared:
                raise _fail(f"schedulingProfiles[{pname}].name", "duplicate profile name")
            refs = []
            for j, r in enumerate(_list(m.get("plugins"), f"schedulingProfiles[{pname}].plugins")):
                rm = _mapping(r, f"schedulingProfiles[{pname}].plugins[{j}]")
                for k in rm:
                    if k not in ("pluginRef", "weight"):
                        raise _fail(f"schedulingProfiles[{pname}].plugins[{j}].{k}",
                                    "unknown field (known: pluginRef, weight)")
                if not rm.get("pluginRef"):
                    raise _fail(f"schedulingProfiles[{pname}].plugins[{j}].pluginRef", "missing")
                ref = _str(rm["pluginRef"], f"schedulingProfiles[{pname}].plugins[{j}].pluginRef")
                if ref not in self.entries:
                    raise _fail(f"schedulingProfiles[{pname}].plugins[{ref}].pluginRef",
                                f"references undefined plugin {ref!r}")
                refs.append((ref, rm.get("weight")))
            declared[pname] = refs
        if not declared:  # llm-d: one `default` profile of every filter, scorer and picker
            declared["default"] = [(e.name, None) for e in self.entries.values()
                                   if e.kind in ("filter", "scorer", "picker")]
            self.note("schedulingProfiles", "mapped", "none given: one `default` profile of every filter, scorer "
                                                      "and picker, as llm-d builds")
        handler, roles = self._handler(declared)
        profiles: dict[str, ProfileSpec] = {}
        for canonical, pname in roles.items():
            profiles[canonical] = self._profile(canonical, pname, declared[pname])
            if canonical != pname:
                self.note(f"schedulingProfiles[{pname}]", "mapped", f"plays the {canonical} profile of {handler.type}")
        for pname in declared:
            if pname not in roles.values():
                self.note(f"schedulingProfiles[{pname}]", "ignored", f"not a profile {handler.type} runs")
        for p in profiles.values():
            _check_rules(p)
        return handler, profiles

    def _handler(self, declared: Mapping[str, Any]) -> tuple[PluginSpec, dict[str, str]]:
        """The profile handler and which declared profile plays each of its roles (canonical -> declared)."""
        handlers = [e for e in self.entries.values() if e.kind == "handler"]
        if len(handlers) > 1:
            raise _fail(f"plugins[{handlers[1].name}]",
                        f"a second profile handler (after {handlers[0].name!r}); only one is allowed")
        if not handlers:
            if len(declared) != 1:
                unsupported = [e.type for e in self.entries.values() if e.kind == "ignored-handler"]
                why = f" ({', '.join(unsupported)} is not supported here)" if unsupported else ""
                raise _fail("plugins", f"no profile handler{why}, and {len(declared)} profiles (one profile runs "
                                       "without a handler; more need disagg-profile-handler)")
            (only,) = declared
            self.note("plugins", "mapped", "no profile handler: single-profile-handler, as llm-d defaults")
            return _plugin("single-profile-handler", "single-profile-handler", {}, "single-profile-handler"), \
                {only: only}
        h = handlers[0]
        if h.type == "single-profile-handler":
            _check_ours(h.type, h.name, h.params)
            if len(declared) != 1:
                raise _fail(f"plugins[{h.name}]", f"single-profile-handler runs one profile, the file declares "
                                                  f"{len(declared)} ({', '.join(declared)})")
            (only,) = declared
            self.note(f"plugins[{h.name}]", "mapped", "single-profile-handler")
            return _plugin(h.type, h.name, {}, h.type), {only: only}
        if h.type == "pd-profile-handler":
            return self._pd_handler(h, declared)
        return self._disagg_handler(h, declared)

    def _roles(self, h: _Entry, decode: str, prefill: str | None, declared: Mapping[str, Any],
               decode_field: str, prefill_field: str) -> dict[str, str]:
        roles = {"decode": decode}
        if prefill is not None:
            roles["prefill"] = prefill
        for canonical, pname in roles.items():
            if pname not in declared:
                fld = decode_field if canonical == "decode" else prefill_field
                raise _fail(f"plugins[{h.name}].parameters.{fld}" if pname != canonical else
                            f"schedulingProfiles[{canonical}]",
                            f"{h.type} needs a {canonical} profile named {pname!r}; the file declares "
                            f"{', '.join(declared) or 'none'}")
        return roles

    def _decider_threshold(self, h: _Entry, field_: str, ref: str) -> int:
        d = self.entries.get(ref)
        if d is None:
            raise _fail(f"plugins[{h.name}].parameters.{field_}", f"references undefined plugin {ref!r}")
        if d.kind != "decider" or d.type == "always-disagg-multimodal-decider":
            raise _fail(f"plugins[{h.name}].parameters.{field_}",
                        f"{ref!r} is a {d.type}, not a prefill decider (prefix-based-pd-decider, "
                        "always-disagg-pd-decider)")
        if d.type == "always-disagg-pd-decider":
            self.note(f"plugins[{ref}]", "mapped", f"always-disagg-pd-decider -> threshold 1 of {h.name} (a "
                                                   "prompt with any uncached token is prefilled apart)")
            return 1
        n = d.params.get("nonCachedTokens", 0)
        try:
            n = _int_at_least(0)(n)
        except _Bad:
            raise _fail(f"plugins[{ref}].parameters.nonCachedTokens", f"must be an integer >= 0, got {_show(n)}") \
                from None
        self.note(f"plugins[{ref}]", "mapped", f"nonCachedTokens {n} -> threshold {n} of {h.name}")
        if "promptTokens" in d.params:
            self.note(f"plugins[{ref}].parameters.promptTokens", "ignored",
                      "no prompt-length gate: the threshold counts uncached tokens only")
        return n

    def _pd_handler(self, h: _Entry, declared: Mapping[str, Any]) -> tuple[PluginSpec, dict[str, str]]:
        extra = _LLMD_EXTRA_PARAMS["pd-profile-handler"]
        params = _check_ours(h.type, h.name, h.params, extra)
        entry = f"plugins[{h.name}]"
        decode = h.params.get("decodeProfile") or "decode"
        prefill = h.params.get("prefillProfile") or "prefill"
        if "threshold" not in h.params:
            ref = h.params.get("deciderPluginName") or "prefix-based-pd-decider"
            if ref in self.entries or "deciderPluginName" in h.params:
                params["threshold"] = self._decider_threshold(h, "deciderPluginName", ref)
            else:
                self.note(f"{entry}.parameters.threshold", "mapped", f"not given and no decider: the default, "
                                                                     f"{params['threshold']}")
        elif "deciderPluginName" in h.params:
            self.note(f"{entry}.parameters.deciderPluginName", "warning", "threshold is given: the decider's "
                                                                         "nonCachedTokens is not used")
        for k, why in (("primaryPort", "we name the prefill worker in x-prefiller-host-port; no port rewrite"),
                       ("prefixPluginType", "our handler reads the KV index directly"),
                       ("prefixPluginName", "our handler reads the KV index directly"),
                       ("prefixMatchInfoProducerName", "our handler reads the KV index directly"),
                       ("hashBlockSize", "a character-based hash block; we count uncached tokens from the KV "
                                         "index in its own blocks")):
            if k in h.params:
                self.note(f"{entry}.parameters.{k}", "ignored", why)
        self.note(entry, "mapped", f"pd-profile-handler, threshold {params['threshold']}")
        roles = self._roles(h, str(decode), str(prefill), declared, "decodeProfile", "prefillProfile")
        return _plugin("pd-profile-handler", h.name, params, h.type), roles

    def _disagg_handler(self, h: _Entry, declared: Mapping[str, Any]) -> tuple[PluginSpec, dict[str, str]]:
        entry = f"plugins[{h.name}]"
        p = h.params
        profiles_ = _mapping(p.get("profiles"), f"{entry}.parameters.profiles")
        deciders = _mapping(p.get("deciders"), f"{entry}.parameters.deciders")
        for sub, known in ((profiles_, ("decode", "prefill", "encode")), (deciders, ("prefill", "encode"))):
            for k in sub:
                if k not in known:
                    fld = "profiles" if sub is profiles_ else "deciders"
                    raise _fail(f"{entry}.parameters.{fld}.{k}", f"unknown field (known: {', '.join(known)})")
        decode = profiles_.get("decode") or p.get("decodeProfile") or "decode"
        prefill = profiles_.get("prefill") or p.get("prefillProfile") or "prefill"
        pd_field = "deciders.prefill" if deciders.get("prefill") else (
            "prefillDeciderPluginName" if p.get("prefillDeciderPluginName") else "deciderPluginName")
        pd_ref = deciders.get("prefill") or p.get("prefillDeciderPluginName") or p.get("deciderPluginName")
        order = str(p.get("stageOrder") or "decode-first").lower().replace("_", "").replace("-", "")
        if order not in ("decodefirst", "decode", "prefillfirst", "prefill"):
            raise _fail(f"{entry}.parameters.stageOrder", f"must be decode-first or prefill-first, got "
                                                          f"{_show(p.get('stageOrder'))}")
        if order.startswith("prefill"):
            if pd_ref:
                raise _fail(f"{entry}.parameters.stageOrder", "a prefill decider needs stageOrder decode-first "
                                                              "(llm-d refuses it too)")
            self.note(f"{entry}.parameters.stageOrder", "warning", "prefill-first is not supported: decode is "
                                                                  "chosen first")
        if deciders.get("encode") or p.get("encodeDeciderPluginName"):
            self.note(f"{entry}.parameters.deciders.encode", "ignored", _NO_ENCODE)
        if not pd_ref:
            self.note(entry, "mapped", f"disagg-profile-handler without a prefill decider -> single-profile-handler "
                                       f"on profile {decode!r} (llm-d: P/D off)")
            roles = self._roles(h, str(decode), None, declared, "profiles.decode", "profiles.prefill")
            return _plugin("single-profile-handler", h.name, {}, h.type), roles
        threshold = self._decider_threshold(h, pd_field, str(pd_ref))
        self.note(entry, "mapped", f"disagg-profile-handler -> pd-profile-handler, threshold {threshold}")
        roles = self._roles(h, str(decode), str(prefill), declared, "profiles.decode", "profiles.prefill")
        return _plugin("pd-profile-handler", h.name, {"threshold": threshold}, h.type), roles

    def _profile(self, canonical: str, pname: str, refs: Sequence[tuple[str, Any]]) -> ProfileSpec:
        where = f"schedulingProfiles[{pname}]"
        filters: list[PluginSpec] = []
        scorers: list[tuple[PluginSpec, float]] = []
        picker: PluginSpec | None = None
        folded: list[tuple[_Entry, float | None]] = []
        fold_at: int | None = None
        for ref, weight in refs:
            e = self.entries[ref]
            at = f"{where}.plugins[{ref}]"
            self.referenced.add(ref)
            if weight is not None and (isinstance(weight, bool) or not isinstance(weight, (int, float))
                                       or not math.isfinite(weight)):
                raise _fail(f"{at}.weight", f"must be a number, got {_show(weight)}")
            if e.kind.startswith("ignored-"):
                w = f" (weight {weight:g} dropped)" if weight is not None else ""
                self.note(at, "ignored", f"{e.type} is not applied{w}: see plugins[{ref}]")
                continue
            if e.kind not in ("filter", "scorer", "picker"):
                raise _fail(at, f"{e.type} is a {e.kind}, not a filter, scorer or picker")
            if weight is not None and e.kind != "scorer":
                self.note(f"{at}.weight", "ignored", f"{e.type} is a {e.kind}: only scorers are weighted")
            if e.kind == "filter":
                filters.append(self._our_plugin(e))
            elif e.kind == "picker":
                if picker is not None:
                    raise _fail(at, f"a second picker in one profile (after {picker.name!r})")
                picker = self._our_plugin(e)
            elif e.type in FOLDED_SCORERS:
                if fold_at is None:
                    fold_at = len(scorers)
                folded.append((e, weight))
            else:
                w = 1.0 if weight is None else float(weight)
                if w < 0:
                    raise _fail(f"{at}.weight", f"must be >= 0 for {e.type}, got {weight}")
                scorers.append((self._our_plugin(e), w))
        if folded:
            scorers = self._fold(where, scorers, folded, fold_at or 0)
        if picker is None:
            picker = self._default_picker(where)
        return ProfileSpec(canonical, tuple(filters), tuple(scorers), picker)

    def _fold(self, where: str, scorers: list[tuple[PluginSpec, float]], folded: list[tuple[_Entry, float | None]],
              at: int) -> list[tuple[PluginSpec, float]]:
        """llm-d's prefix and load scorers become one kv-block-cost-scorer (the profile's own, if it names
        one); every weight they carried is named, because a cost is not a weighted sum."""
        sources = ",".join(e.type for e, _ in folded)
        for e, w in folded:
            shown = f"{w:g}" if w is not None else "1 (llm-d's default)"
            self.note(f"{where}.plugins[{e.name}]", "warning",
                      f"{e.type} folded into kv-block-cost-scorer; its weight {shown} is dropped (our cost adds "
                      "cached and queued blocks in one unit, not weighted normalised scores)")
            first = e.name not in self.produced
            self._producer_settings(e)
            if first and e.type in ("active-request-scorer", "load-aware-scorer"):
                for k in e.params:
                    self.note(f"plugins[{e.name}].parameters.{k}", "ignored", "load is counted in blocks, "
                                                                              "booked by this picker")
        existing = [i for i, (s, _) in enumerate(scorers) if s.type == "kv-block-cost-scorer"]
        if existing:
            i = existing[0]
            s, w = scorers[i]
            merged = _plugin(s.type, s.name, s.parameters, f"{s.source_type},{sources}")
            return scorers[:i] + [(merged, w)] + scorers[i + 1:]
        cost = _plugin("kv-block-cost-scorer", "kv-block-cost-scorer",
                       _check_ours("kv-block-cost-scorer", "kv-block-cost-scorer", {}), sources)
        return scorers[:at] + [(cost, 1.0)] + scorers[at:]

    def _default_picker(self, where: str) -> PluginSpec:
        for e in self.entries.values():
            if e.kind == "picker":
                p = self._our_plugin(e)
                self.note(f"{where}", "mapped", f"no picker: {e.name!r} ({p.type}), the first picker in "
                                                "plugins, as llm-d fills it")
                return p
        self.note(f"{where}", "mapped", "no picker: min-cost-picker (llm-d adds a max-score-picker)")
        return _plugin("min-cost-picker", "min-cost-picker", {}, "max-score-picker")

    def _our_plugin(self, e: _Entry) -> PluginSpec:
        """An entry of kind filter/scorer/picker as our PluginSpec (llm-d's name mapped, params checked)."""
        if e.name in self.compiled:
            return self.compiled[e.name]
        p = self._compile_plugin(e)
        self.compiled[e.name] = p
        self.note(f"plugins[{e.name}]", "mapped", p.type if p.type == e.type else f"llm-d's {e.type} -> {p.type}")
        return p

    def _compile_plugin(self, e: _Entry) -> PluginSpec:
        if e.type in OUR_TYPES:
            extra = _LLMD_EXTRA_PARAMS.get(e.type, frozenset())
            params = _check_ours(e.type, e.name, e.params, extra)
            for k in e.params:
                if k in extra:
                    self.note(f"plugins[{e.name}].parameters.{k}", "ignored", "we choose one endpoint per profile")
            return _plugin(e.type, e.name, params, e.type)
        ours = _PICKER_ALIASES[e.type]
        for k in e.params:
            self.note(f"plugins[{e.name}].parameters.{k}", "ignored", "we choose one endpoint per profile")
        return _plugin(ours, e.name, _check_ours(ours, e.name, {}), e.type)

    # --- producers, detectors and sections

    def _producer_settings(self, e: _Entry) -> None:
        """What a prefix producer (or a scorer carrying the producer's settings) says that we have a flag for."""
        if e.name in self.produced:
            return
        self.produced.add(e.name)
        at = f"plugins[{e.name}].parameters"
        p = e.params
        if e.type in ("precise-prefix-cache-producer", "precise-prefix-cache-scorer"):
            tp = _mapping(p.get("tokenProcessorConfig"), f"{at}.tokenProcessorConfig")
            for k in ("blockSizeTokens", "blockSize"):
                if tp.get(k):
                    self._block_size(tp[k], f"{at}.tokenProcessorConfig.{k}")
                    break
            if "hashSeed" in tp:
                self.note(f"{at}.tokenProcessorConfig.hashSeed", "ignored", "we key blocks by the hashes the "
                                                                           "workers' own KV events carry")
            kv = _mapping(p.get("kvEventsConfig"), f"{at}.kvEventsConfig")
            if kv.get("topicFilter"):
                self.set("kv_event_topic", _str(kv["topicFilter"], f"{at}.kvEventsConfig.topicFilter"),
                         f"{at}.kvEventsConfig.topicFilter", "ZMQ topic prefix")
            pod = _mapping(kv.get("podDiscoveryConfig"), f"{at}.kvEventsConfig.podDiscoveryConfig")
            if "socketPort" in pod:
                port = pod["socketPort"]
                if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
                    raise _fail(f"{at}.kvEventsConfig.podDiscoveryConfig.socketPort",
                                f"must be a port 1..65535, got {_show(port)}")
                self.set("kv_event_port", port, f"{at}.kvEventsConfig.podDiscoveryConfig.socketPort",
                         "each worker's KV-event port")
            if kv.get("zmqEndpoint"):
                self.note(f"{at}.kvEventsConfig.zmqEndpoint", "ignored", "we subscribe to each worker's own "
                          "publisher (tcp://<worker ip>:--kv-event-port, or `;kv=` in --endpoints), not one "
                          "central endpoint")
            for k in ("discoverPods", "concurrency", "engineType"):
                if k in kv:
                    self.note(f"{at}.kvEventsConfig.{k}", "ignored", "we always subscribe per worker, one "
                                                                     "reader per publisher")
            if "indexerConfig" in p:
                self.note(f"{at}.indexerConfig", "ignored", "our index's cap is --max-index-blocks-per-worker")
            if "speculativeTTL" in p:
                self.set("prediction_ttl_s", _duration_s(p["speculativeTTL"], f"{at}.speculativeTTL"),
                         f"{at}.speculativeTTL", "how long a pick counts as cached before its events")
            if p.get("speculativeIndexing") is False:
                self.note(f"{at}.speculativeIndexing", "warning", "we always credit a pick's blocks until its "
                                                                  "KV events confirm them (--prediction-ttl-s)")
        elif e.type in ("approx-prefix-cache-producer", "prefix-cache-scorer"):
            if p.get("blockSizeTokens"):
                self._block_size(p["blockSizeTokens"], f"{at}.blockSizeTokens")
            for k, why in (("autoTune", "we learn each worker's block size from it anyway"),
                           ("blockSize", "a character-based block; our blocks are tokens"),
                           ("maxPrefixBlocksToMatch", "we match the whole prompt"),
                           ("maxPrefixTokensToMatch", "we match the whole prompt"),
                           ("lruCapacityPerServer", "our index is fed by KV events; its cap is "
                                                    "--max-index-blocks-per-worker"),
                           ("prefixMatchInfoProducerName", "our scorer reads our KV index"),
                           ("matchLengthWeight", "the block cost credits every cached block"),
                           ("matchLengthScaleTokens", "the block cost credits every cached block")):
                if k in p:
                    self.note(f"{at}.{k}", "ignored", why)

    def _block_size(self, v: Any, entry: str) -> None:
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise _fail(entry, f"must be a positive integer, got {_show(v)}")
        self.set("kv_cache_block_size", v, entry, "tokens per KV block until a worker reports its own")

    def _unreferenced(self) -> None:
        """Producers, detectors and data-layer plugins: what each maps to; scheduling plugins no profile uses."""
        for e in self.entries.values():
            at = f"plugins[{e.name}]"
            if e.kind == "producer" and e.type in LLMD_MAPPED:
                self.note(at, "mapped", f"{e.type} -> our KV index, fed by the workers' KV events")
                self._producer_settings(e)
            elif e.type in _MAPPED_AS_FEATURE:
                self.note(at, "mapped", f"{e.type} -> {_MAPPED_AS_FEATURE[e.type]}")
            elif e.kind == "decider" and not any(n.entry == at for n in self.notes):
                self.note(at, "ignored", "no profile handler uses this decider")
            elif e.kind == "detector" and e.type == "utilization-detector" and e.name not in self.detectors:
                self.note(at, "ignored", "not the saturation detector (flowControl.saturationDetector)")
            elif e.kind in ("filter", "scorer", "picker") and e.name not in self.referenced:
                self.note(at, "ignored", "no profile that runs references it")

    def _flow_control(self, gates: Mapping[str, bool]) -> None:
        fc = _mapping(self.doc.get("flowControl"), "flowControl")
        legacy = self.doc.get("saturationDetector")
        sd = fc.get("saturationDetector")
        if legacy is not None:
            self.note("saturationDetector", "warning", "deprecated top-level field: llm-d reads "
                                                       "flowControl.saturationDetector first")
            if sd is None:
                sd = legacy
        sd_ref = "utilization-detector"
        if sd is not None:
            sdm = _mapping(sd, "flowControl.saturationDetector")
            for k in sdm:
                if k != "pluginRef":
                    raise _fail(f"flowControl.saturationDetector.{k}", "unknown field (known: pluginRef)")
            sd_ref = sdm.get("pluginRef") or "utilization-detector"
            if sd_ref not in self.entries and sd_ref != "utilization-detector":
                raise _fail("flowControl.saturationDetector.pluginRef", f"references undefined plugin {sd_ref!r}")
        det = self.entries.get(sd_ref)
        if det is not None:
            self.detectors.add(det.name)
            self._detector(det)
        known = {"maxBytes", "maxRequests", "defaultRequestTTL", "noEndpointRequestTTL", "defaultPriorityBand",
                 "defaultNegativePriorityBand", "priorityBands", "usageLimitPolicyPluginRef", "saturationDetector",
                 "enableEviction"}
        for k in fc:
            if k not in known:
                raise _fail(f"flowControl.{k}", f"unknown field (known: {', '.join(sorted(known))})")
        # read (and so checked) even when the gate is off: llm-d decodes the section strictly either way
        limit = _quantity(fc["maxRequests"], "flowControl.maxRequests") if "maxRequests" in fc else None
        ttl = (_duration_s(fc["defaultRequestTTL"], "flowControl.defaultRequestTTL")
               if "defaultRequestTTL" in fc else None)
        if any(k != "saturationDetector" for k in fc) and not gates.get("flowControl"):
            self.note("flowControl", "warning", "the flowControl feature gate is off: its settings (other than "
                                                "saturationDetector) are ignored, as llm-d does")
            return
        if limit is not None:
            self.set("flow_control_max_queued_requests", limit, "flowControl.maxRequests", "request limit")
        if ttl is not None:
            self.set("flow_control_queue_ttl_s", ttl, "flowControl.defaultRequestTTL", "longest wait in the queue")
        for k, why in (("maxBytes", "our queue is bounded in requests (--flow-control-max-queued-requests)"),
                       ("noEndpointRequestTTL", "one TTL for every queued request (--flow-control-queue-ttl-s)"),
                       ("defaultPriorityBand", "bands come from InferenceObjectives; no per-band limits"),
                       ("defaultNegativePriorityBand", "bands come from InferenceObjectives; no per-band limits"),
                       ("priorityBands", "bands come from InferenceObjectives; no per-band limits"),
                       ("usageLimitPolicyPluginRef", "no usage-limit policy"),
                       ("enableEviction", "no eviction of running requests")):
            if k in fc:
                self.note(f"flowControl.{k}", "ignored", why)

    def _detector(self, e: _Entry) -> None:
        at = f"plugins[{e.name}].parameters"
        if e.type != "utilization-detector":
            if not e.kind.startswith("ignored-"):
                raise _fail("flowControl.saturationDetector.pluginRef", f"{e.name!r} is a {e.type}, not a "
                                                                         "saturation detector")
            return
        p = e.params
        if "queueDepthThreshold" in p:
            v = p["queueDepthThreshold"]
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise _fail(f"{at}.queueDepthThreshold", f"must be an integer >= 0, got {_show(v)}")
            self.set("queue_depth_threshold", v, f"{at}.queueDepthThreshold", "saturation: queued requests")
        if "kvCacheUtilThreshold" in p:
            v = p["kvCacheUtilThreshold"]
            try:
                v = _float_check(0.0, strict=True)(v)
            except _Bad:
                raise _fail(f"{at}.kvCacheUtilThreshold", f"must be a number > 0, got {_show(v)}") from None
            self.set("kv_cache_util_threshold", v, f"{at}.kvCacheUtilThreshold", "saturation: KV utilisation")
        if "metricsStalenessThreshold" in p:
            s = _duration_s(p["metricsStalenessThreshold"], f"{at}.metricsStalenessThreshold")
            self.set("worker_metrics_staleness_ms", int(round(s * 1000)), f"{at}.metricsStalenessThreshold",
                     "metrics older than this are ignored")
        if "headroom" in p:
            self.note(f"{at}.headroom", "ignored", "no saturation headroom")
        self.note(f"plugins[{e.name}]", "mapped", "utilization-detector -> our saturation rule")

    def _data_layer(self) -> None:
        dl = _mapping(self.doc.get("dataLayer"), "dataLayer")
        known = ("injectDefaults", "sources", "discovery", "peerDiscovery", "crossReplicaSyncerPluginRef",
                 "crossReplicaSyncInterval")
        for k in dl:
            if k not in known:
                raise _fail(f"dataLayer.{k}", f"unknown field (known: {', '.join(known)})")
        for i, s in enumerate(_list(dl.get("sources"), "dataLayer.sources")):
            sm = _mapping(s, f"dataLayer.sources[{i}]")
            ref = _str(sm.get("pluginRef"), f"dataLayer.sources[{i}].pluginRef")
            if ref not in self.entries:
                raise _fail(f"dataLayer.sources[{ref}].pluginRef", f"references undefined plugin {ref!r}")
            for j, x in enumerate(_list(sm.get("extractors"), f"dataLayer.sources[{ref}].extractors")):
                xref = _str(_mapping(x, f"dataLayer.sources[{ref}].extractors[{j}]").get("pluginRef"),
                            f"dataLayer.sources[{ref}].extractors[{j}].pluginRef")
                if xref not in self.entries:
                    raise _fail(f"dataLayer.sources[{ref}].extractors[{xref}].pluginRef",
                                f"references undefined plugin {xref!r}")
        if dl.get("sources"):
            self.note("dataLayer.sources", "mapped", "sources and extractors as their plugins map (see plugins[...])")
        for k, why in (("injectDefaults", "we always scrape worker metrics unless --worker-metrics-interval-ms 0"),
                       ("discovery", "workers come from --endpoints, --endpoints-file or --inference-pool-name"),
                       ("peerDiscovery", "replicas find each other with --peers / --peer-service"),
                       ("crossReplicaSyncerPluginRef", _SYNC),
                       ("crossReplicaSyncInterval", _SYNC)):
            if k in dl:
                self.note(f"dataLayer.{k}", "ignored", why)

    def _request_handler(self) -> None:
        rh = _mapping(self.doc.get("requestHandler"), "requestHandler")
        for k in rh:
            if k != "parsers":
                raise _fail(f"requestHandler.{k}", "unknown field (known: parsers)")
        refs = [_str(_mapping(x, f"requestHandler.parsers[{i}]").get("pluginRef"),
                     f"requestHandler.parsers[{i}].pluginRef")
                for i, x in enumerate(_list(rh.get("parsers"), "requestHandler.parsers"))]
        if self.doc.get("parser") is not None:
            self.note("parser", "warning", "deprecated top-level field: llm-d reads requestHandler.parsers first")
            refs.append(_str(_mapping(self.doc["parser"], "parser").get("pluginRef"), "parser.pluginRef"))
        for ref in refs:
            if ref not in self.entries and ref not in LLMD_KNOWN:
                raise _fail(f"requestHandler.parsers[{ref}].pluginRef", f"references undefined plugin {ref!r}")
        if refs:
            self.note("requestHandler.parsers", "ignored", _OPENAI)


def _check_rules(profile: ProfileSpec) -> None:
    plugins = [*profile.filters, *(s for s, _ in profile.scorers), profile.picker]
    for rule in RULES:
        a = next((p for p in plugins if p.type == rule.a), None)
        b = next((p for p in plugins if p.type == rule.b), None)
        if a is not None and b is not None:
            raise _fail(f"schedulingProfiles[{profile.name}]",
                        f"{rule.a} ({a.name!r}) cannot be combined with {rule.b} ({b.name!r}): {rule.why}")


# ------------------------------------------------------------------------------------------------- public API


def parse_config(doc: str | Mapping[str, Any]) -> SchedulingSpec:
    """Compile an EndpointPickerConfig (YAML/JSON text, or the parsed mapping) into a SchedulingSpec.

    Raises ConfigFileError naming the entry and field for anything that cannot be compiled; everything it
    compiles or drops is in the spec's notes (`report_lines`)."""
    if isinstance(doc, str):
        import yaml

        try:
            data = yaml.safe_load(doc)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
            what = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise ConfigFileError(f"not YAML{where}: {what}") from None
    else:
        data = doc
    if not isinstance(data, Mapping):
        raise ConfigFileError(f"an {KIND} is a mapping (apiVersion, kind, plugins, ...), got "
                              f"{type(data).__name__}")
    return _Compiler(data).compile()


def load_config_file(path: str) -> SchedulingSpec:
    """Read and compile one config file. Bounded: a file over 1 MiB is refused before it is parsed (a config
    is a few KiB; a larger one is a wrong path, and YAML's cost grows with its input)."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise ConfigFileError(f"{path}: cannot read: {e.strerror or e}") from None
    if len(data) > MAX_FILE_BYTES:
        raise ConfigFileError(f"{path}: larger than {MAX_FILE_BYTES} bytes; a config file is a few KiB")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigFileError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    try:
        return parse_config(text)
    except ConfigFileError as e:
        raise ConfigFileError(f"{path}: {e}") from None


def spec_from_config(config: Any) -> SchedulingSpec:
    """Today's flags as a spec: the default profiles the flags describe, so flags and file run one path.
    `config` is the scheduling section (`config.sections.scheduling`, what `assemble` hands it) or a whole
    `Config`: only the scheduling options are read.

    Always a pd-profile-handler with `decode` and `prefill` profiles, each with its role filter: whether the
    pool has prefill workers is known only at run time, and the handler answers the decode profile alone when
    it has none. The decode profile prices with the block cost (or, `--cost-model time`, the predicted time)
    and picks with the load bound (`--affinity-load-bound`), else the softmax (`--router-temperature`), else
    the argmin. The prefill profile always prices with the block cost and picks without the bound (the bound
    keeps a destination's cache affinity; a prefill leg has no answer to keep). `--eviction-aware` adds the
    eviction scorer to both. Under the time cost the temperature applies (softmax over predicted times) and the
    load bound does not (a warning names a bound set away from its default)."""
    notes: list[Note] = []
    block_params = _check_ours("kv-block-cost-scorer", "kv-block-cost-scorer",
                               {"overlapCredit": float(config.kv_overlap_score_credit),
                                "prefillLoadScale": float(config.prefill_load_scale)})
    block = (_plugin("kv-block-cost-scorer", "kv-block-cost-scorer", block_params, "kv-block-cost-scorer"), 1.0)
    temperature = float(config.router_temperature)
    plain = (_plugin("softmax-picker", "softmax-picker", {"temperature": temperature}, "softmax-picker")
             if temperature > 0 else _plugin("min-cost-picker", "min-cost-picker", {}, "min-cost-picker"))
    bound, tiered_bound = config.affinity_bounds()
    if config.cost_model == "time":
        tiered_bound = None  # no bounded-load picker under the time cost
        decode_scorers = [(_plugin("predicted-time-scorer", "predicted-time-scorer",
                                   _check_ours("predicted-time-scorer", "predicted-time-scorer", block_params),
                                   "predicted-time-scorer"), 1.0)]
        picker = plain
        if config.affinity_load_bound:  # set, and not 0: a bound the time cost ignores
            notes.append(Note("affinity_load_bound", "warning",
                              f"affinity_load_bound {config.affinity_load_bound:g} does not apply with cost_model "
                              "time: the predicted time prices the load itself (a config file may combine "
                              "predicted-time-scorer with bounded-load-picker)"))
    else:
        decode_scorers = [block]
        if bound > 0:
            params: dict[str, Any] = {"bound": bound, "temperature": temperature, "rule": str(config.affinity_rule)}
            if tiered_bound is not None:
                params["tieredBound"] = tiered_bound
            picker = _plugin("bounded-load-picker", "bounded-load-picker", params, "bounded-load-picker")
        else:
            picker = plain
    prefill_scorers = [block]
    if config.eviction_aware:
        eviction = (_plugin("eviction-scorer", "eviction-scorer", {}, "eviction-scorer"), 1.0)
        decode_scorers.append(eviction)
        prefill_scorers.append(eviction)
    if config.tiered_credit_enabled():
        # last: it adds to `credited`, which the eviction scorer sets outright (tiered_credit_scorer.py); a
        # GPU-only pool's default spec is unchanged (the plugin is compiled only when tier credit is asked for)
        weights: dict[str, float] = {}
        if config.router_host_cache_hit_weight is not None:
            weights["hostWeight"] = float(config.router_host_cache_hit_weight)
        if config.router_disk_cache_hit_weight is not None:
            weights["diskWeight"] = weights["sharedWeight"] = float(config.router_disk_cache_hit_weight)
        tiered = (_plugin("tiered-credit", "tiered-credit", _check_ours("tiered-credit", "tiered-credit", weights),
                          "tiered-credit"), 1.0)
        decode_scorers.append(tiered)
        prefill_scorers.append(tiered)
        widened = (f"; the load bound is {_show(tiered_bound)} while any worker holds blocks off the GPU "
                   f"({_show(bound)} otherwise; --affinity-load-bound sets one bound for both)"
                   if tiered_bound is not None else "")
        notes.append(Note("tiered_credit", "mapped", "blocks off the GPU are credited per tier (" + ", ".join(
            f"{k}={_show(v)}" for k, v in tiered[0].parameters.items()) + ")" + widened + "; vLLM workers need "
            "self_describing_kv_events=true on their OffloadingConnector (vLLM 0.32.0 has it): without it they publish "
            "placeholder offload events, which earn nothing (counted as skipped_placeholder in /debug/kv)"))
    handler = _plugin("pd-profile-handler", "pd-profile-handler",
                      {"threshold": int(config.pd_min_uncached_tokens)}, "pd-profile-handler")
    profiles = {
        "decode": ProfileSpec("decode", (_plugin("decode-filter", "decode-filter", {}, "decode-filter"),),
                              tuple(decode_scorers), picker),
        "prefill": ProfileSpec("prefill", (_plugin("prefill-filter", "prefill-filter", {}, "prefill-filter"),),
                               tuple(prefill_scorers), plain),
    }
    for p in profiles.values():
        _check_rules(p)
    notes.append(Note("flags", "mapped", "today's flags compiled to the default profiles (decode, prefill)"))
    return SchedulingSpec(handler, MappingProxyType(profiles), MappingProxyType({}), tuple(notes))


def spec_to_yaml(spec: SchedulingSpec) -> str:
    """The EndpointPickerConfig (apiVersion llm-d.ai/v1alpha1) a spec is, in our canonical types:
    `parse_config(spec_to_yaml(s)) == s`. Settings are written where llm-d's shape holds them (a
    precise-prefix-cache-producer's block size, port, topic and TTL; featureGates and flowControl; a
    utilization-detector's thresholds)."""
    import yaml

    plugins: dict[str, dict[str, Any]] = {}

    def add(p: PluginSpec) -> None:
        entry: dict[str, Any] = {"type": p.type}
        if p.name != p.type:
            entry = {"name": p.name, **entry}
        if p.parameters:
            entry["parameters"] = dict(p.parameters)
        if p.name in plugins and plugins[p.name] != entry:
            raise ValueError(f"two different plugins are both named {p.name!r}")
        plugins[p.name] = entry

    add(spec.handler)
    profiles = []
    for prof in spec.profiles.values():
        refs: list[dict[str, Any]] = []
        for f in prof.filters:
            add(f)
            refs.append({"pluginRef": f.name})
        for s, w in prof.scorers:
            add(s)
            refs.append({"pluginRef": s.name, "weight": w})
        add(prof.picker)
        refs.append({"pluginRef": prof.picker.name})
        profiles.append({"name": prof.name, "plugins": refs})
    doc: dict[str, Any] = {"apiVersion": API_VERSION, "kind": KIND}
    st = dict(spec.settings)
    if "flow_control" in st:
        doc["featureGates"] = ["flowControl" if st.pop("flow_control") else "flowControl=false"]
    producer: dict[str, Any] = {}
    if "kv_cache_block_size" in st:
        producer["tokenProcessorConfig"] = {"blockSizeTokens": st.pop("kv_cache_block_size")}
    kv: dict[str, Any] = {}
    if "kv_event_topic" in st:
        kv["topicFilter"] = st.pop("kv_event_topic")
    if "kv_event_port" in st:
        kv["podDiscoveryConfig"] = {"socketPort": st.pop("kv_event_port")}
    if kv:
        producer["kvEventsConfig"] = kv
    if "prediction_ttl_s" in st:
        producer["speculativeIndexing"] = True
        producer["speculativeTTL"] = _go_duration(st.pop("prediction_ttl_s"))
    if producer:
        plugins["precise-prefix-cache-producer"] = {"type": "precise-prefix-cache-producer", "parameters": producer}
    detector: dict[str, Any] = {}
    if "queue_depth_threshold" in st:
        detector["queueDepthThreshold"] = st.pop("queue_depth_threshold")
    if "kv_cache_util_threshold" in st:
        detector["kvCacheUtilThreshold"] = st.pop("kv_cache_util_threshold")
    if "worker_metrics_staleness_ms" in st:
        detector["metricsStalenessThreshold"] = _go_duration(st.pop("worker_metrics_staleness_ms") / 1000)
    fc: dict[str, Any] = {}
    if detector:
        plugins["utilization-detector"] = {"type": "utilization-detector", "parameters": detector}
        fc["saturationDetector"] = {"pluginRef": "utilization-detector"}
    if "flow_control_max_queued_requests" in st:
        fc["maxRequests"] = st.pop("flow_control_max_queued_requests")
    if "flow_control_queue_ttl_s" in st:
        fc["defaultRequestTTL"] = _go_duration(st.pop("flow_control_queue_ttl_s"))
    if st:
        raise ValueError(f"settings with no place in an {KIND}: {', '.join(sorted(st))}")
    doc["plugins"] = list(plugins.values())
    doc["schedulingProfiles"] = profiles
    if fc:
        doc["flowControl"] = fc
    return yaml.safe_dump(doc, sort_keys=False, default_flow_style=False)


def report_lines(spec: SchedulingSpec) -> list[str]:
    """Human lines for start-up: what runs (handler, each profile's chain), then each note: what mapped,
    what was ignored and why, and the warnings."""
    h = spec.handler
    params = ", ".join(f"{k}={_show(v)}" for k, v in h.parameters.items())
    lines = [f"scheduling: {h.type}" + (f" ({params})" if params else "")
             + (f" from {h.source_type}" if h.source_type != h.type else "")]
    for p in spec.profiles.values():
        chain = [f.type for f in p.filters] + [f"{s.type} x{w:g}" for s, w in p.scorers]
        chain.append(p.picker.type + ("" if not p.picker.parameters else
                                      " (" + ", ".join(f"{k}={_show(v)}" for k, v in p.picker.parameters.items()) + ")"))
        lines.append(f"  profile {p.name}: " + " -> ".join(chain))
    for k, v in spec.settings.items():
        lines.append(f"  setting {k} = {_show(v)}")
    for n in spec.notes:
        lines.append(f"  {n.status:<7} {n.entry}: {n.detail}")
    return lines


__all__ = ["API_VERSION", "DEPRECATED_API_VERSION", "FOLDED_SCORERS", "LLMD_KNOWN", "LLMD_MAPPED", "OUR_TYPES",
           "RULES", "ConfigFileError", "Note", "PluginSpec", "ProfileSpec", "Rule", "SchedulingSpec",
           "load_config_file", "parse_config", "report_lines", "spec_from_config", "spec_to_yaml"]
