"""``vlkv serve``: an OpenAI-compatible HTTP server over the continuous-batching scheduler.

Modules: ``cli`` (the command), ``app`` (FastAPI routes), ``schemas`` (request bodies), ``translate``
(bodies → prompt, policy, sampler), ``media`` (image parts), ``engine_loop`` (the one thread that
steps the scheduler), ``detok`` (incremental detokenization), ``metrics`` (Prometheus), ``config``.
FastAPI, uvicorn, pydantic and prometheus_client come with the ``serve`` extra and are imported only
when the server starts.
"""
