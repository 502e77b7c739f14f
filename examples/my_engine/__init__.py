"""`my_engine`, the engine the docs' examples name (`my_engine.worker:Worker`, `my_engine.serve:main`): the toy
tensor- and pipeline-parallel engine of `rayfree.cli.toy_engine`, under the names the docs use, so that every
command and snippet in README.md and docs/ runs as written (tests/ops/test_doc_blocks.py runs them from this
folder's parent, examples/)."""
