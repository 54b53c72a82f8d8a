"""The embedded CPU engine: a vLLM-compatible subset of the OpenAI API served from one process.

* ``server``: the Flask app (``create_engine_app``), its admin and token routes, the CLI
  (``python -m app.engines.embedded.server``; gunicorn: ``workers/engine_conf.py``);
* ``generate``: the generation routes (chat completions, completions; stream and non-stream);
* ``engine``: one process's model, tokenizer and scheduler (``Engine``, ``build_engine``);
* ``batching``: the continuous-batching scheduler (``BatchScheduler``), with ``prefix_cache``
  (reused prompt KV) and ``sampling`` (the sampling rules);
* ``validation``: request fields and their 400s (``EngineError``);
* ``templates``: the chat template the engine renders prompts with (the warm start renders
  with it too), and ``toolparse``, which parses its tool calls back;
* ``outputs``: response objects and stream chunks.

The model code both this engine and the trainer use is ``app.engines.modeling``.
"""
