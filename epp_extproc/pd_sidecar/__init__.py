"""The decode-side P/D sidecar (``epp-pd-sidecar``): in front of one decode worker, it runs a request's
prefill leg on the prefill worker the picker named in ``x-prefiller-host-port`` and its decode leg locally.
docs/pd-sidecar.md is the user documentation."""
