"""Same node: the shared-memory segment, the ring's publish/consume protocol, its slot layout, how a
process waits for a flag, and the bulk copies of big payloads. The only room that touches the ring's
flags or its mapping.
"""
