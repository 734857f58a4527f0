"""The program: the command line, the TOML config file, the router server assembly, the
local simulated deployment, config checks, and the worker command."""
