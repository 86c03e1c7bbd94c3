"""Scheduling as plugins (issue 41): filters, scorers, pickers and profile handlers, one per file, composed by
one EndpointPickerConfig (config_file.py: a file, or today's flags compiled to one) and built by build.py.

The seam: a profile's filters narrow the addresses, the candidate table (table.py) is filled once over them,
scorers return one cost per row, a picker returns a row (profile.py). A new plugin is one file here plus one
line in registry.py. Nothing in this package imports the Envoy edge or the whole configuration.
"""
