"""The KV event plane on NATS (issue 47): `epp-kv-relay` (relay.py), the picker's follower (follower.py), their
wire (wire.py) and the NATS link both keep (link.py). See docs/kv-event-plane.md."""
