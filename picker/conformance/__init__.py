"""The EPP conformance kit (``kv-epp conformance``): drives any endpoint picker over raw ext_proc gRPC the way a
GIE gateway does, and checks the GIE endpoint-picker protocol. It knows the picker under test only by its wire: it
imports nothing else of kv-epp (an import contract checks it), so it cannot share kv-epp's mistakes.
See docs/conformance.md.
"""
