"""Deterministic filler text for workloads: prose, code and identifiers that tokenize like real agent traffic."""
from __future__ import annotations

import random

_WORDS = (
    "the a to of and in for is that with on as by this be are from it at or an if not when each all which must "
    "should will can use only then into after before return value request cache block token prompt model server "
    "client engine page table prefix hash tree node batch queue step decode prefill latency budget memory tensor "
    "layer head kernel thread lock state error retry timeout config option default file path module function class "
    "method test fixture assert check build install run deploy commit branch merge review patch diff line column "
    "index offset length count size limit range list dict string integer float boolean schema field type name id "
    "user tool result call argument parameter output input stream chunk event handler callback route endpoint "
    "status code message response header body json yaml markdown format parse render template encode decode"
).split()
_IDENTS = (
    "cache manager scheduler request block page token prefix tree node batch queue router handler config parser "
    "renderer stream worker session tenant metrics loader writer reader buffer index table pool client server"
).split()


class TextGen:
    """All randomness of a workload flows through one seeded ``random.Random``: same seed, same bytes."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def sentence(self, min_words: int = 6, max_words: int = 18) -> str:
        words = self.rng.choices(_WORDS, k=self.rng.randint(min_words, max_words))
        return " ".join(words).capitalize() + "."

    def prose(self, num_words: int) -> str:
        """About ``num_words`` words of sentences grouped into paragraphs."""
        sentences, count = [], 0
        while count < num_words:
            s = self.sentence()
            sentences.append(s)
            count += s.count(" ") + 1
        paragraphs = [" ".join(sentences[i : i + 5]) for i in range(0, len(sentences), 5)]
        return "\n\n".join(paragraphs)

    def ident(self) -> str:
        return "_".join(self.rng.sample(_IDENTS, 2))

    def path(self) -> str:
        return "/".join([self.rng.choice(["engine", "server", "kernels", "tests", "benchmarks"]), self.ident() + ".py"])

    def code(self, num_lines: int) -> str:
        """Python-looking source of ``num_lines`` lines."""
        lines: list[str] = []
        while len(lines) < num_lines:
            fn = self.ident()
            args = ", ".join(self.rng.sample(_IDENTS, self.rng.randint(1, 3)))
            lines.append(f"def {fn}({args}):")
            lines.append(f'    """{self.sentence(4, 10)}"""')
            for _ in range(self.rng.randint(2, 6)):
                lines.append(f"    {self.ident()} = {self.ident()}({self.rng.choice(_IDENTS)}, {self.rng.randint(0, 4096)})")
            lines.append(f"    return {self.ident()}")
            lines.append("")
        return "\n".join(lines[:num_lines])

    def tool_output(self, num_words: int) -> str:
        """A tool result: file contents, a test log or a search listing, about ``num_words`` words long."""
        kind = self.rng.choice(("file", "log", "grep"))
        if kind == "file":
            return self.code(max(2, num_words // 5))
        if kind == "log":
            return "\n".join(
                f"{self.path()}::test_{self.ident()} {self.rng.choice(['PASSED', 'PASSED', 'FAILED'])}"
                for _ in range(max(1, num_words // 3))
            )
        return "\n".join(
            f"{self.path()}:{self.rng.randint(1, 900)}: {self.sentence(3, 9)}" for _ in range(max(1, num_words // 8))
        )
