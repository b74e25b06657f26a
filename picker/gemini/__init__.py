"""Google Generative Language API backends (``type: gemini``): the request conversion and the context cache."""
