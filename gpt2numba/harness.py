"""The documented path of the lm-evaluation-harness model (integrations/harness.py): `import gpt2numba.harness`
registers the model "gpt2numba", `python -m gpt2numba.harness ...` runs lm-eval's command line with it."""

from .integrations.harness import GPT2NumbaLM, main

if __name__ == "__main__":
    main()
