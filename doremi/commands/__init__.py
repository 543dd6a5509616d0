"""The `doremi` command line: the parser, and the verbs that are no pipeline stage (config, inspect, export/import, verify, the config docs)."""
