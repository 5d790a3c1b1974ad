"""The applications built on the library: ``train.py`` (the main job: a small GPT with a
vocabulary-parallel LM head, under torchrun) and ``verify.py`` (the sharded loss against
the unsharded reference on every rank). They live here, beside the installed package
``vocab_parallel`` and not in it, because the model, the data pipeline, the optimizer
engine and the launcher's options are one application's choices, not the library's API;
the library needs torch alone. The modules are importable as ``launch.*`` from the
repository root (the tests do so), and the two jobs run as scripts.
"""
