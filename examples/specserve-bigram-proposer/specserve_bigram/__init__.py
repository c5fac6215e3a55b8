"""An out-of-tree specserve proposer, as a third party would ship one (see docs/plugins.md).

BigramProposer remembers, per request, which token last followed each token of that request (prompt
and output so far) and drafts by following that chain from the last token: cheap prompt lookup of
n = 1 that also learns from what the request has generated. Drafts are deterministic, so it returns
no distributions (q = one-hot) and stays exact for greedy and sampled requests alike.

Install it next to specserve (`pip install examples/specserve-bigram-proposer`) and run
`specserve serve --speculative-method bigram`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specserve.engine.proposer import ProposalRequest, Proposals, Proposer, ProposerContext
from specserve.engine.request import Request


@dataclass
class _History:
    successor: dict[int, int] = field(default_factory=dict)  # token -> the token that last followed it
    num_indexed: int = 0  # tokens of the request already folded into `successor`


class BigramProposer(Proposer):
    name = "bigram"

    def __init__(self, ctx: ProposerContext):
        super().__init__(ctx)
        self._histories: dict[str, _History] = {}

    def propose(self, batch: list[ProposalRequest]) -> Proposals:
        drafts = []
        for item in batch:
            tokens = item.request.all_token_ids
            history = self._histories.setdefault(item.request.request_id, _History())
            # Only committed tokens are ever indexed, so rejected drafts never need undoing.
            for i in range(max(0, history.num_indexed - 1), len(tokens) - 1):
                history.successor[tokens[i]] = tokens[i + 1]
            history.num_indexed = len(tokens)
            drafts.append(self._follow(history.successor, tokens[-1], item.num_speculative_tokens))
        return Proposals(token_ids=drafts, probs=[None] * len(batch))

    @staticmethod
    def _follow(successor: dict[int, int], token: int, k: int) -> list[int]:
        chain: list[int] = []
        while len(chain) < k and token in successor:
            token = successor[token]
            chain.append(token)
        return chain

    def on_finished(self, request: Request) -> None:
        self._histories.pop(request.request_id, None)
