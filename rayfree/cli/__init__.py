"""Operations tooling above the four layers: the `rayfree` command (node, demo, doctor, keygen) and the
toy engine the demo runs. Nothing in transport, cluster, worker or executor imports it."""
