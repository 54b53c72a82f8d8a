"""Inference engines and the project's one client of them.

* ``client`` (``EngineClient``), ``stream`` (``ChatStream``: a streamed answer read on the caller's
  thread), ``errors`` and ``transport`` (non-stream connections that watch for a departed caller):
  how every other package talks to an engine;
* ``sse``: the server-sent-events parser (client and gateway);
* ``disconnect``: the probe of a departed client (embedded engine and gateway);
* ``modeling``: model building, loading and saving (embedded engine and trainer);
* ``embedded``: the embedded CPU engine;
* ``vllm``: the vLLM adapter (serve command line, weight reload, worker extension).

The scripted engine the tests and conformance checks run is a test double and lives in
``app.conformance.scripted``.
"""
