"""`epp-extproc conformance HOST:PORT`: drive any ext_proc endpoint picker and check the endpoint-picker
protocol's MUSTs (Gateway API Inference Extension, docs/proposals/004-endpoint-picker-protocol).

No EPP conformance profile exists upstream (GAIE #753 asked for one); this package is the check a gateway
operator or another picker's author can run against a live picker, speaking ext_proc as Envoy does.
`protocol` builds and reads the messages, `client` talks gRPC, `checks` holds one function per rule,
`report` prints the verdicts and `runner` is the command line. With `--envoy`, `gateway` starts a real Envoy
(the project's own config generator and process harness, `epp_extproc.dev`) and stand-in workers in front of
the picker, and `envoy_checks` checks the same rules end to end through it. Nothing here imports the picker
itself.
"""
