"""The OpenAI wire format: typed models of every shape that crosses a process or storage boundary."""
