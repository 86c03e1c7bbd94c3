"""KV-event ingest apart from the decisions (`--kv-ingest apart`): see docs/ingest-apart.md.

`server.py` is an ingest shard (subscriptions, decoding, the index of its workers), run as
`python -m epp_extproc.ingest` by `launcher.py`, which the picker (or the `--processes` supervisor) starts and
restarts itself; `wire.py` is the local channel's layout; the picker's side is `adapters/kv_remote.py`.
"""
