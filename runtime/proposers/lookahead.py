"""Lookahead decoding (Fu et al., 2024) as a proposer: speculation from the target's own guesses, no draft model.

Every verification pass also carries a Jacobi window: guesses for the W positions after the root at N - 1 levels,
level 0 the oldest. Reading the target's argmax at the newest level gives a new guess per column, one Jacobi
iteration further; the window then drops level 0 and takes the new guesses on top. Each column's guesses, read
across the levels, form an n-gram (a token, then N - 1 guesses of what follows it), which goes into a pool keyed by
its first token. The pool's n-grams that start with the root are the candidates the pass verifies, as a trie.

The window rides in the pass as ``Draft`` extra rows that no tree node sees, so it never changes what the tree's
nodes compute: the output is the target's (greedy or by the exact sampling acceptance). Its guesses are the
target's argmax even when sampling, so the candidates are deterministic functions of the history.

Layout. Level 0's column 0 is the root itself (the last emitted token, a tree node), so level 0 adds W - 1 rows and
each other level W: (N - 1) W - 1 rows in the order level 0 columns 1 .. W - 1, level 1 columns 0 .. W - 1, ...
The guess at level l, column j stands at position root + j + l and sees what a sequence would: the root, level 0's
columns 1 .. j, then its own column's guesses at levels 1 .. l. After each pass the window moves one position
forward whatever was accepted (as the reference implementation does by default): its guesses are only a source of
n-grams, and a window kept aligned to the accepted text would have to be refilled at every long acceptance.

``lookahead+ngram`` is prompt lookup first (runtime/proposers/lookup_first.py): where lookup finds a continuation,
its tree is verified at the size adaptive sizing learned for lookup, without the window; elsewhere this proposer's
trie and window. The earlier form, lookup's continuations joined into this proposer's trie, capped them at the
trie's size; the two forms measured the same speed (scripts/results/README.md, "Lookahead decoding"), and this one
sizes each drafter's trees by its own rule.

Recycled successors (Luo et al., 2024, "Turning Trash into Treasure"). A verification pass computes the target's
logits at every tree node, and all but the accepted path's are thrown away. Their top-k are the target's guesses of
what follows each node's token; the ``SuccessorTable`` keeps them for each token and each pair of tokens, with the
target's probabilities, averaged over the contexts each was seen in (``RECENT_WEIGHT``). The tree's nodes that the
pool's n-grams leave free (R of them at least, ``LookaheadSettings.recycled``) are filled from it best-first by the
product of those probabilities along a path: the root's likeliest successors, theirs, and so on. The table is a
deterministic function of the history and the earlier passes' logits, like the pool, so the exact acceptance keeps
the output the target's. On a CPU, where each extra row costs, recycled nodes are right far more often than the
window's n-grams for the same rows (scripts/results/README.md, "Recycled successors"), and the cost curve gives
them most of the pass.

A token the table has never recorded gives a recycled tree nothing to hold, and a token recorded in one context holds
that context's guess. The target's context-free successors of every token (``runtime.proposers.successor_prior``: each
token placed where a reply starts, measured once per target) fill both gaps: they are a token's entry where it has none,
and are mixed into its own entry (``PRIOR_WEIGHT``) where a pair was never recorded. They matter most where the table
is cold: a generation's own table (sampling, or ``carry`` off) and a server's first requests (scripts/results/
README.md, "A context-free prior for recycled successors").

The table outlives a generation (``LookaheadSettings.carry``, on by default), as Token Recycling's adjacency matrix
is inherited from the previous query: it lives on the proposer, every generation's state holds the same table, and
a target's replies share enough phrasing that a warm table gives a root successors where a fresh one has seen the
token nowhere yet. Greedy generations alone read and record it: the output is the target's argmax whatever is
drafted, while a sampled output depends on the draft through the random draws it consumes, so a sampled generation
keeps a table of its own and a seed draws what it draws alone (exactness needs only that a draft not depend on the
current step's draws; reproducibility needs more). The table is bounded: ``PAIR_CAPACITY`` pairs, the least
recently recorded dropped first, and single tokens by the vocabulary.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from dataclasses import dataclass

import torch

from runtime.proposers.base import Proposer, ProposeInput
from runtime.proposers.spec import LookaheadSettings
from runtime.engine.sampling import CHUNK, SamplingParams, chunk_columns, greedy_tokens
from runtime.engine.tree import Draft, Tree
from runtime.engine.tree_sizing import interpolated_cost
from runtime.proposers.successor_prior import SUCCESSORS, SuccessorPrior, successor_prior
from runtime.target.cost_model import cost_curve

# A prior for choosing W, N and G from the cost curve: a pass gets its first candidate token accepted with
# probability HIT_SCALE * log2(1 + G) (the reference finds the gain growing with the log of the pass's size), and
# each later token of the n-gram with probability CONTINUE given the earlier ones. Fitted to SmolLM2-135M-Instruct on
# MT-bench first turns (tokens per pass 1.32, 1.40, 1.49 at N = 3, G = W = 4, 8, 12; 1.43 at N = 4, G = W = 6).
HIT_SCALE = 0.088
CONTINUE = 0.5
NGRAM_SIZES = (3, 4, 5)
PRIOR_ACCEPTANCE = 0.3
MAX_WINDOW = 16
# Recycled successors: each tree node's SUCCESSORS most likely next tokens are kept (successor_prior.py), with the
# target's probabilities for them. The prior for choosing R: where no n-gram is right, R recycled nodes add
# RECYCLE_SCALE log2(1 + R) accepted tokens a pass. Fitted like HIT_SCALE, with scripts/benchmark.py's `lookahead`
# (tokens per pass 1.76 at W = 1, N = 3, G = 1, R = 7 on every 8th MT-bench first turn, bf16).
# Each recording moves a key's entry this far towards the distribution just computed (``blend_successors``): an
# exponential average over the contexts the key was seen in. The latest context alone (1.0) is right less often
# behind lookup (scripts/results/README.md, "Recycled successors averaged over contexts").
RECENT_WEIGHT = 0.5
# Where a pair was never recorded, a token's own entry is mixed half and half with the target's context-free
# successors of it (``SuccessorPrior``), which alone serve a token never verified before (scripts/results/README.md,
# "A context-free prior for recycled successors").
PRIOR_WEIGHT = 0.5
PAIR_CAPACITY = 1 << 16  # a bound for long-running servers: about 1 KB of Python objects per entry
RECYCLE_SCALE = 0.23
RECYCLED_SIZES = (0, 1, 2, 3, 5, 7, 11, 15)


def window_offsets(window: int, ngram: int) -> torch.Tensor:
    """[E] long, E = (N - 1) W - 1: each window row's position minus the root's (level l, column j: j + l), rows in
    window order (level 0 columns 1 .. W - 1, then each further level's columns 0 .. W - 1)."""
    levels = torch.arange(ngram - 1)[:, None]
    columns = torch.arange(window)[None, :]
    return (levels + columns).flatten()[1:]


def window_mask(window: int, ngram: int) -> torch.Tensor:
    """[E, E] bool: which window rows each window row sees (besides the committed context and the root, which every
    window row sees). The row at level l, column j sees level 0's columns 1 .. j and column j's levels 1 .. l: the
    guesses for positions root + 1 .. root + j + l, a sequence."""
    levels = torch.arange(ngram - 1).repeat_interleave(window)[1:]  # [E]
    columns = torch.arange(window).repeat(ngram - 1)[1:]
    same_column = (columns[:, None] == columns[None, :]) & (levels[None, :] >= 1) & (levels[None, :] <= levels[:, None])
    first_level = (levels[None, :] == 0) & (columns[None, :] <= columns[:, None])
    return same_column | first_level


def window_tokens(levels: torch.Tensor) -> torch.Tensor:
    """[E] long: the window rows' tokens, from levels [N - 1, W] (level 0's column 0, where the root stands, left
    out)."""
    return levels.flatten()[1:]


def jacobi_update(levels: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """levels [N - 1, W] and the newest level's argmax new [W] -> the next window [N - 1, W]: level 0 dropped, the
    others one level down, ``new`` on top. Level l, column j moves to level l - 1 at the same column, which stands
    one position earlier: the window moves one position forward."""
    return torch.cat([levels[1:], new[None]])


def window_ngrams(levels: torch.Tensor, root: int, new: torch.Tensor) -> torch.Tensor:
    """[W, N] long: column j's n-gram, levels[0, j] (the root for column 0), levels[1 .. N - 2, j], new[j].
    levels [N - 1, W] is the window the pass verified, new [W] the argmax at its newest level."""
    grams = torch.cat([levels, new[None]]).T.clone()
    grams[0, 0] = root
    return grams


class NgramPool:
    """N-grams by first token: for each, up to ``capacity`` continuations (tuples of N - 1 tokens), least recently
    seen dropped first."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"NgramPool capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.grams: dict[int, list[tuple[int, ...]]] = {}

    def add(self, ngrams: torch.Tensor) -> None:
        """ngrams [K, N] long, in order (a later row counts as seen later)."""
        for first, *rest in ngrams.tolist():
            continuation = tuple(rest)
            known = self.grams.setdefault(first, [])
            if continuation in known:
                known.remove(continuation)
            elif len(known) >= self.capacity:
                del known[0]
            known.append(continuation)

    def candidates(self, token: int) -> list[tuple[int, ...]]:
        """The continuations of ``token``, most recently seen first."""
        return self.grams.get(token, [])[::-1]

    def __len__(self) -> int:
        return sum(len(known) for known in self.grams.values())


class SuccessorTable:
    """The target's top-k next tokens after a token, and after a pair of tokens, with their probabilities, from the
    verification passes that computed them (at a tree node holding that token, after its parent's token): each
    recording blends into the entry with ``recent_weight`` (1.0: the latest recording alone). With a ``prior``, a
    token's entry is mixed with the prior's (``prior_weight`` of it), and a token never recorded has the prior's."""

    def __init__(self, pair_capacity: int = PAIR_CAPACITY, recent_weight: float = RECENT_WEIGHT,
                 prior: SuccessorPrior | None = None, prior_weight: float = PRIOR_WEIGHT):
        if pair_capacity < 1:
            raise ValueError(f"SuccessorTable pair_capacity must be >= 1, got {pair_capacity}")
        if not 0 < recent_weight <= 1:
            raise ValueError(f"SuccessorTable recent_weight must be in (0, 1], got {recent_weight}")
        if not 0 <= prior_weight < 1:
            raise ValueError(f"SuccessorTable prior_weight must be in [0, 1), got {prior_weight}")
        self.pair_capacity = pair_capacity
        self.recent_weight = recent_weight
        self.prior = prior
        self.prior_weight = prior_weight
        self.after_token: dict[int, tuple[tuple[int, float], ...]] = {}
        # in the order last recorded (a dict keeps insertion order), so the oldest pair is the first
        self.after_pair: dict[tuple[int, int], tuple[tuple[int, float], ...]] = {}

    def record(self, before: list[int], tokens: list[int], successors: list[list[int]],
               probs: list[list[float]]) -> None:
        """Each node's token, the token before it, its top-k successors (best first) and the target's probabilities
        for them, in order: each blends into its token's and its pair's entries (``blend_successors``), a later node
        after an earlier one."""
        pairs, weight = self.after_pair, self.recent_weight
        for previous, token, top, chance in zip(before, tokens, successors, probs):
            entry = tuple(zip(top, chance))
            self.after_token[token] = blend_successors(self.after_token.get(token, ()), entry, weight)
            # popped and put back: the pair becomes the most recently recorded
            pairs[(previous, token)] = blend_successors(pairs.pop((previous, token), ()), entry, weight)
        while len(pairs) > self.pair_capacity:
            del pairs[next(iter(pairs))]

    def entry(self, previous: int, token: int) -> tuple[tuple[int, float], ...]:
        """(successor, probability) pairs recorded after the pair (``previous``, ``token``), else after ``token``
        alone (mixed with the prior's entry for it), else the prior's; () without any."""
        found = self.after_pair.get((previous, token))
        if found:
            return found
        own = self.after_token.get(token, ())
        if self.prior is None:
            return own
        prior = self.prior.entry(token)
        if not own:
            return prior
        return blend_successors(own, prior, self.prior_weight) if self.prior_weight else own

    def successors(self, previous: int, token: int) -> tuple[int, ...]:
        """The successors of ``entry``, likeliest first."""
        return tuple(t for t, _ in self.entry(previous, token))

    def scored_paths(self, previous: int, root: int, count: int) -> list[tuple[tuple[int, ...], float]]:
        """Up to ``count`` (continuation of ``root``, its score), best first: a path scores the product of its
        tokens' recorded probabilities (what EAGLE-2 ranks its draft tree by, here the target's own, from the times
        it saw each token), and each path's prefix comes before it, so a trie of the first n paths has n + 1
        nodes."""
        found: list[tuple[tuple[int, ...], float]] = []
        frontier: list[tuple[float, int, tuple[int, ...], int, int]] = []  # (-score, order, path, previous, token)
        order = 0

        def expand(path: tuple[int, ...], before: int, token: int, score: float) -> None:
            nonlocal order
            for following, chance in self.entry(before, token):
                heapq.heappush(frontier, (-score * chance, order, path + (following,), token, following))
                order += 1

        expand((), previous, root, 1.0)
        while frontier and len(found) < count:
            negative, _, path, before, token = heapq.heappop(frontier)
            found.append((path, -negative))
            expand(path, before, token, -negative)
        return found

    def paths(self, previous: int, root: int, count: int) -> list[tuple[int, ...]]:
        """``scored_paths`` without the scores."""
        return [path for path, _ in self.scored_paths(previous, root, count)]

    def __len__(self) -> int:
        return len(self.after_token)


def blend_successors(old: tuple[tuple[int, float], ...], new: tuple[tuple[int, float], ...], weight: float,
                     keep: int = SUCCESSORS) -> tuple[tuple[int, float], ...]:
    """The ``keep`` likeliest (token, probability) of the mixture (1 - weight) old + weight new, likeliest first
    (ties in the order old's tokens, then new's). A token missing from one side counts as 0 there. Weight 1 is
    ``new`` as it is."""
    if weight == 1:
        return new
    mixed = {token: (1 - weight) * chance for token, chance in old}
    for token, chance in new:
        mixed[token] = mixed.get(token, 0.0) + weight * chance
    return tuple(sorted(mixed.items(), key=lambda item: -item[1])[:keep])


def token_before_root(history: torch.Tensor) -> int:
    """The token before the root history[-1] (history [L]), the first half of the root's pair key; -1 for none."""
    return int(history[-2]) if history.numel() > 1 else -1


def chunked_topk(values: torch.Tensor, k: int, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest of each row of values [R, V] -> (values [R, k], indices [R, k] long), largest first: the
    values ``torch.topk`` gives; among equal values the indices may differ from its choice (deterministically).

    Each of the k largest lies in one of the k chunks with the largest maxima, so the top-k of those k chunks'
    columns is the rows' top-k: a pass over the row's chunk maxima (``chunk_columns``) and a top-k over k * chunk
    columns, several times faster on CPU than a top-k over a vocabulary-wide row."""
    rows = values.shape[0]
    if k >= -(-values.shape[1] // chunk):
        return values.topk(k, dim=-1)
    blocks = chunk_columns(values, chunk)
    _, best = blocks.amax(-1).topk(k, dim=-1)  # [R, k] chunk indices
    candidates = blocks.gather(1, best[:, :, None].expand(rows, k, chunk)).view(rows, k * chunk)
    top, where = candidates.topk(k, dim=-1)
    return top, best.gather(1, where // chunk) * chunk + where % chunk


def top_probabilities(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [R, V] -> (probabilities [R, k], tokens [R, k] long): the softmax's k largest entries of each row,
    largest first, as ``chunked_topk(logits.float().softmax(-1), k)`` gives them up to fp32 rounding. The top-k is
    taken over the logits and only the normalizer over the whole row, which spares a softmax's full-size output
    (about half the time on CPU)."""
    widened = logits.to(torch.float32, copy=True)  # a copy of its own: the normalizer is computed in place
    top, tokens = chunked_topk(widened, k)
    largest = top[:, :1]
    normalizer = widened.sub_(largest).exp_().sum(-1, keepdim=True)
    return (top - largest).exp() / normalizer, tokens


def record_successors(table: SuccessorTable, history: torch.Tensor, tree: Tree, logits: torch.Tensor) -> None:
    """Record the successors the target computed at ``tree``'s nodes (logits [N, V]; the root is history[-1])."""
    probs, top = top_probabilities(logits, min(SUCCESSORS, logits.shape[-1]))
    tokens = tree.tokens.tolist()
    parents = tree.parents.tolist()
    before = [token_before_root(history)] + [tokens[parent] for parent in parents[1:]]
    table.record(before, tokens, top.tolist(), probs.tolist())


def expected_tokens(settings: LookaheadSettings, scale: float = HIT_SCALE, keep: float = CONTINUE,
                    recycle: float = RECYCLE_SCALE) -> float:
    """Tokens a pass emits under the prior (bonus included): a candidate's first token right with probability
    ``scale`` log2(1 + G), each further token of its n-gram with probability ``keep``; where no n-gram's first token
    is right, R recycled nodes add ``recycle`` log2(1 + R) tokens."""
    first = min(1.0, scale * math.log2(1 + settings.candidates))
    recycled = recycle * math.log2(1 + settings.recycled)
    return 1 + first * sum(keep ** k for k in range(settings.ngram - 1)) + (1 - first) * recycled


def pass_rows(settings: LookaheadSettings) -> int:
    """Rows of a pass with a full tree: its nodes and the window's rows."""
    return settings.tree_size + settings.window_rows


def choose_settings(curve: dict[int, float]) -> tuple[LookaheadSettings, str]:
    """(settings, why): the W, N, G (G = W, as the reference does) and R with the most expected tokens per unit of pass
    cost on ``curve`` ({rows: cost relative to one row}, ``runtime.target.cost_model.cost_curve``), among passes no
    larger than the largest measured one."""
    largest = max(curve)
    options = [LookaheadSettings(w, n, w, r) for n in NGRAM_SIZES for w in range(1, MAX_WINDOW + 1)
               for r in RECYCLED_SIZES]
    options = [s for s in options if pass_rows(s) <= largest] or [LookaheadSettings(1, 3, 1)]
    best = max(options, key=lambda s: expected_tokens(s) / interpolated_cost(curve, pass_rows(s)))
    value = expected_tokens(best) / interpolated_cost(curve, pass_rows(best))
    return best, (f"{best}: {pass_rows(best)} rows a pass, the most tokens per unit of pass cost on this machine's "
                  f"cost curve under the prior ({value:.2f}x plain decoding's)")


def check_settings_pay(settings: LookaheadSettings, curve: dict[int, float], context: int) -> None:
    """Refuse sizes no pass can pay for: a pass whose rows cost, on ``curve`` (this machine's cost curve, extrapolated
    in proportion past its largest size), as much as the most tokens its tree can return decoded one at a time; or
    one that does not fit the target's ``context``. The error gives the largest window that would do."""
    rows, most = pass_rows(settings), settings.tree_size
    cost = interpolated_cost(curve, rows)
    if cost < most and rows < context:
        return
    fitting = [w for w in range(1, MAX_WINDOW * 64) if pass_rows(dataclasses.replace(settings, window=w)) < context
               and interpolated_cost(curve, pass_rows(dataclasses.replace(settings, window=w))) < most]
    fix = (f"a window of at most {max(fitting)} with these N, G and R" if fitting else
           "fewer candidates or recycled nodes")
    why = (f"more than the target's context of {context} positions" if rows >= context else
           f"about {cost:.0f} one-row passes on this machine's cost curve, more than the {most} tokens its tree can "
           f"return at most")
    raise ValueError(f"lookahead {settings}: a pass carries {rows} rows, {why}; give {fix}, or leave the sizes out "
                     f"to have them chosen from the cost curve")


@dataclass
class LookaheadState:
    """One generation's window and pool. ``root``: the root of the pass whose window's logits come back next (None
    before the first pass); ``updates``: Jacobi updates so far (the first n-grams are read once every level after
    level 0 holds the target's guesses, not the prompt tokens the window starts from)."""

    levels: torch.Tensor  # [N - 1, W] long
    pool: NgramPool
    successors: SuccessorTable
    offsets: torch.Tensor  # [E] long
    mask: torch.Tensor  # [E, E] bool
    root: int | None = None
    updates: int = 0


class LookaheadProposer(Proposer):
    """Lookahead decoding with ``settings`` (W, N, G, R), recycling into ``successors`` (default: a table of its own
    when ``settings.carry``, kept across its generations) and its tables drawing on ``prior`` where they have no
    entry of their own (``SuccessorTable``; a table given as ``successors`` keeps its own prior).

    Its trees are as wide as G candidates side by side, which adaptive sizing (a chain model) would shrink to one
    candidate: the decoder verifies trees of its own ``tree_size`` (1 + G (N - 1), ``own_tree_size``) unless given
    a tree size. ``reason`` says how the settings were chosen (``tree_size_reason``)."""

    hidden_layers: tuple[int, ...] = ()
    needs_hidden = False
    own_tree_size = True

    name = "lookahead"

    def __init__(self, settings: LookaheadSettings, reason: str | None = None,
                 successors: SuccessorTable | None = None, prior: SuccessorPrior | None = None):
        if not isinstance(settings, LookaheadSettings):
            raise TypeError(f"LookaheadProposer takes LookaheadSettings, not {type(settings).__name__}")
        if successors is not None and not settings.carry:
            raise ValueError("a SuccessorTable to carry across generations was given with LookaheadSettings.carry "
                             "False; give settings with carry=True, or no table")
        if prior is not None and not settings.prior:
            raise ValueError("a SuccessorPrior was given with LookaheadSettings.prior False; give settings with "
                             "prior=True, or no prior")
        self.settings = settings
        # the prior of every table this proposer starts; a table given to it brings its own
        self.prior = prior if prior is not None or successors is None else successors.prior
        # the recycled successors every greedy generation of this proposer reads and records (settings.carry), or
        # None: each generation starts its own. A table given here may be shared with other proposers.
        if successors is None and settings.carry and settings.recycled:
            successors = SuccessorTable(prior=prior)
        self.successors = successors
        self.extra_rows = settings.window_rows
        self.observes_logits = settings.recycled
        self.tree_size = settings.tree_size
        self.tree_size_reason = reason or f"{settings}"
        # recycled paths go as deep as the tree allows
        self.max_depth = settings.ngram - 1 if not settings.recycled else None
        # what sizing by the cost model assumes where the proposer's own size does not apply (a batch of rows)
        self.expected_acceptance = PRIOR_ACCEPTANCE

    @classmethod
    def for_target(cls, target, settings: LookaheadSettings | None = None):
        """With ``settings``, or with the settings chosen from ``target``'s measured cost curve; with ``target``'s
        successor prior (measured once, cached) where the settings recycle successors and ask for one, unless
        measuring it would take too long on this device (``runtime.proposers.successor_prior.PRIOR_BUDGET_SECONDS``)."""
        if settings is not None:
            check_settings_pay(settings, cost_curve(target), target.max_positions)
            reason = f"{settings}, as given"
        else:
            settings, reason = choose_settings(cost_curve(target))
        prior = None
        if settings.recycled and settings.prior:
            prior = successor_prior(target)
        return cls(settings, reason=reason, prior=prior)

    def start(self, prompt: torch.Tensor, max_length: int, sampling: SamplingParams | None = None) -> LookaheadState:
        """A generation's state; it records into the carried table (``successors``) unless ``sampling`` samples, in
        which case it starts a table of its own."""
        s = self.settings
        # The window starts from prompt tokens drawn with a fixed seed (the reference draws them at random): a
        # rerun repeats every guess.
        generator = torch.Generator().manual_seed(0)
        picks = torch.randint(prompt.numel(), (s.ngram - 1, s.window), generator=generator)
        device = prompt.device
        carried = self.successors is not None and (sampling is None or sampling.greedy)
        successors = self.successors if carried else SuccessorTable(prior=self.prior)
        return LookaheadState(prompt[picks.to(device)], NgramPool(s.candidates), successors,
                              window_offsets(s.window, s.ngram).to(device), window_mask(s.window, s.ngram).to(device))

    def propose(self, state: LookaheadState, step: ProposeInput) -> Draft:
        s = self.settings
        if step.extra_logits is not None and state.root is not None:
            new = greedy_tokens(step.extra_logits[-s.window:])  # the newest level's rows come last
            if state.updates >= s.ngram - 2:  # levels 1 .. N - 2 hold the target's guesses by now
                state.pool.add(window_ngrams(state.levels, state.root, new))
            state.levels = jacobi_update(state.levels, new)
            state.updates += 1
        root = int(step.history[-1])
        sequences = state.pool.candidates(root)[: s.candidates]
        if s.recycled:  # the n-grams' nodes first; recycled paths fill the tree's other nodes
            sequences = sequences + state.successors.paths(token_before_root(step.history), root,
                                                           step.tree_size - 1)
        tree = Tree.from_sequences(root, sequences, step.tree_size, device=step.history.device)
        state.root = root
        return Draft(tree, window_tokens(state.levels), state.offsets, state.mask)

    def observe(self, state: LookaheadState, history: torch.Tensor, tree: Tree, logits: torch.Tensor) -> None:
        """Recycle the successors the target computed at the verified tree's nodes (``runtime.proposers.base``)."""
        if self.settings.recycled:
            record_successors(state.successors, history, tree, logits)
