"""kvindex: which worker holds which prompt prefix, built from the workers' own KV events."""
