"""The batch-1 decode engine, its worker and its benchmark.

Importing this package (and `inference.events`, `inference.protocol`) must stay free of torch:
the web process imports them and never loads model code.
"""
