r"""Prompt templates: how a problem becomes the text of the one user message a policy sees.

Two templates are registered in `PROMPT_TEMPLATES`: ``"boxed"`` (the default: the problem, a space and an
instruction, by default `BOXED_INSTRUCTION`, which the ``\boxed{}`` rewards read) and ``"dapo"`` (DAPO's template,
in which the BandPO authors' verl scripts wrap every problem: `DAPO_PROMPT_PREFIX` + problem + `DAPO_PROMPT_SUFFIX`;
it asks for a last line ``Answer: ...``, which the ``dapo`` reward reads). Templates are filled by plain
substitution, never `str.format`, so the braces of LaTeX problems are safe.
"""

from __future__ import annotations

from ..core.checks import Choice

BOXED_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."

#: DAPO's prompt around each problem, as in the DAPO-Math-17k prompts (Yu et al., 2025, "DAPO").
DAPO_PROMPT_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
DAPO_PROMPT_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'

#: Template name -> its text, with ``{problem}`` (and, for "boxed", ``{instruction}``) where the values go.
PROMPT_TEMPLATES: dict[str, str] = {
    "boxed": "{problem} {instruction}",
    "dapo": DAPO_PROMPT_PREFIX + "{problem}" + DAPO_PROMPT_SUFFIX,
}
#: Checks a template name: ValueError "prompt_template must be one of [...], got ..." otherwise.
CHECK_TEMPLATE = Choice(tuple(PROMPT_TEMPLATES))


def format_prompt(problem: str, prompt_template: str = "boxed", instruction: str | None = BOXED_INSTRUCTION) -> str:
    r"""The user message for `problem` under `prompt_template` (a name of `PROMPT_TEMPLATES`): for "boxed" the
    problem, a space and `instruction` (None or "": the problem alone); "dapo" ignores `instruction`.

    Example:

    ```python
    >>> format_prompt("What is $1 + 1$?")
    "What is $1 + 1$? Let's think step by step and output the final answer within \\boxed{}."
    >>> format_prompt("What is $1 + 1$?", "dapo").splitlines()[2]
    'What is $1 + 1$?'
    ```
    """
    CHECK_TEMPLATE(prompt_template, "prompt_template")
    if prompt_template == "boxed":
        return f"{problem} {instruction}" if instruction else problem
    return PROMPT_TEMPLATES[prompt_template].replace("{problem}", problem)
