# The `rayfree_cluster` fixture (rayfree.testing) for the tests in this folder.
pytest_plugins = ["rayfree.testing"]
