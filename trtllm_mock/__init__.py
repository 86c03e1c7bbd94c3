"""trtllm_mock: a trtllm-serve double that behaves, and fails, like the real server."""
