"""The APIs beside the OpenAI core, each a translation onto it: Anthropic Messages, OpenAI
Responses, SGLang's native routes, vLLM's tokenize and render routes, and the RL / admin
routes (new weights, pauses, sleep). They use the core's public interface (state.py,
generation.py, protocol.py, request_body.py, errors.py) and are added to the app by server.py."""
