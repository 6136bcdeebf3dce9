"""The prompt: messages rendered with the checkpoint's chat template (conversation.py, tool_calls.py), the image
expansions and one tokenization into typed chunks (build.py, chunks.py), their rope positions (positions.py,
mrope.py), and the answer's stop strings (stop_strings.py)."""
