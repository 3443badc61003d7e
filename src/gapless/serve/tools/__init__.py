"""Tool calling for the OpenAI API and the training gateway: formats and their parsers
(parsers.py), forced calls as grammars (choice.py), tools and tool history as chat messages for
templates without tool support (render.py), and a request's tool setup (request.py)."""
