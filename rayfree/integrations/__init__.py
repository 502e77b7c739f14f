"""Engines on rayfree: adapters that put an engine's own executor contract on top of rayfree's.

Each adapter is an optional extra (`pip install 'rayfree[vllm]'`); nothing here is imported by
`import rayfree`.
"""
