"""Modules generated from proto/ by `make proto` (grpcio-tools); never edit by hand."""
