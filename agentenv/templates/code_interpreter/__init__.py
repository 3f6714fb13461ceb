"""The `code-interpreter` template: a Jupyter-kernel HTTP server for the e2b-code-interpreter SDK.

`server.py` runs *inside* the sandbox (its own interpreter and venv, never imported by agentenv);
`build.py` is the template's build recipe, run by the server through the normal template builder.
"""
