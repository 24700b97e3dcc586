"""Question-answering workloads with gold answers, for checking what a model answers.

Each workload is a list of :class:`Question` s: retrieved documents (best first), a question
and its gold answers. Questions of one conversation share a ``conversation`` and come in
turn order. Generated workloads are about invented things (names, places and values made
up from syllables), so a model can only answer from its context, never from memory, and
the documents are retrieved by a real lexical retriever (BM25 over the whole corpus, with a
small seeded jitter standing in for a retriever's noise): the ranking means what a
retriever's ranking means, and shared documents come back in different orders.

- ``facts``: documents of ~60 tokens about bridges, companies, ships, festivals,
  mountains and beetles, each stating four attributes; a question asks one attribute of
  one entity; the other retrieved documents are of the same kind (the same attributes with
  other values: the distractors a reader must not copy from).
- ``memory``: a user's memory as ~20 short snippets (~15 tokens: "The user's sister lives
  in Porvela.") out of 40, questions about one of them.
- ``facts-chat`` and ``memory-chat``: conversations of three turns whose later questions
  ask about a document an earlier turn retrieved (it comes back, so de-duplication replaces
  it with a reference: the case references must answer as well in).
- ``multihop``: the bundled MultiHop-RAG sample's inference questions (their gold answers
  ship with it), with their BM25 top documents (real news, ~800 tokens each).

The same seed always gives the same questions.
"""

from __future__ import annotations

import math
import random
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ...core.blocks import Block
from ...errors import ContextPilotError

__all__ = ["WORKLOADS", "Question", "WorkloadError", "bm25_rank", "workload"]


class WorkloadError(ContextPilotError, ValueError):
    """An unknown workload or a size out of range; the message says which."""


@dataclass(frozen=True, slots=True)
class Question:
    """One question over its retrieved documents, with the answers counted as right."""

    id: str
    blocks: tuple[Block, ...]
    """The retrieved documents, best first."""
    question: str
    answers: tuple[str, ...]
    conversation: str | None = None
    """Questions sharing one are turns of one conversation, in order."""
    gold: str | None = None
    """The id of the document that holds the answer (None: not known)."""


# ---- retrieval --------------------------------------------------------------------------------------------
_TERM = re.compile(r"[a-z0-9]+")


def _terms(text: str) -> list[str]:
    return _TERM.findall(text.lower())


def bm25_rank(
    query: str, corpus: Sequence[Block], k: int, rng: random.Random | None = None, jitter: float = 0.0
) -> list[Block]:
    """The ``k`` documents of ``corpus`` that BM25 (k1 1.2, b 0.75) scores highest for
    ``query``, best first; ``jitter``: each score times a draw from [1 - jitter, 1 + jitter]
    (a retriever's noise), drawn from ``rng``."""
    documents = [Counter(_terms(block.text)) for block in corpus]
    lengths = [sum(terms.values()) for terms in documents]
    average = sum(lengths) / len(lengths)
    frequency = Counter(term for terms in documents for term in terms)
    size = len(corpus)
    scores = []
    for terms, length in zip(documents, lengths, strict=True):
        score = 0.0
        for term in set(_terms(query)):
            tf = terms.get(term, 0)
            if tf:
                idf = math.log(1 + (size - frequency[term] + 0.5) / (frequency[term] + 0.5))
                score += idf * tf * 2.2 / (tf + 1.2 * (0.25 + 0.75 * length / average))
        if jitter and rng is not None:
            score *= 1 + rng.uniform(-jitter, jitter)
        scores.append(score)
    best = sorted(range(size), key=lambda i: -scores[i])[:k]
    return [corpus[i] for i in best]


# ---- invented names and values ----------------------------------------------------------------------------
_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "kr", "st", "tr")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ou")
_CODAS = ("", "", "n", "r", "l", "s", "th")
_FIRST = ("Mira", "Tomas", "Ilse", "Oren", "Katya", "Ruben", "Selma", "Darius", "Nadia", "Elio", "Greta",
          "Hugo", "Lena", "Marek", "Odile", "Pavel", "Rosa", "Soren", "Talia", "Viktor")  # fmt: skip


class _Names:
    """Invented words, never the same one twice in a workload."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.used: set[str] = set()

    def word(self, syllables: tuple[int, int] = (2, 3)) -> str:
        while True:
            parts = [
                self.rng.choice(_ONSETS) + self.rng.choice(_VOWELS) + self.rng.choice(_CODAS)
                for _ in range(self.rng.randint(*syllables))
            ]
            word = "".join(parts).capitalize()
            if word not in self.used and len(word) <= 12:
                self.used.add(word)
                return word

    def person(self) -> str:
        return f"{self.rng.choice(_FIRST)} {self.word()}"


# ---- facts ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Attribute:
    statement: str  # "{entity}" and "{value}"
    question: str  # "{entity}"
    value: Callable[[_Names], str]


def _year(names: _Names) -> str:
    return str(names.rng.randint(1701, 1989))


def _number(low: int, high: int) -> Callable[[_Names], str]:
    return lambda names: f"{names.rng.randint(low, high):,}"


_KINDS: dict[str, tuple[str, str, tuple[_Attribute, ...]]] = {
    # kind: (entity pattern, opening sentence, attributes)
    "bridge": ("the {name} Bridge", "{Entity} is a stone bridge in the north of the valley.", (
        _Attribute("{Entity} was completed in {value}.", "In which year was {entity} completed?", _year),
        _Attribute("It was designed by the engineer {value}.", "Who designed {entity}?", _Names.person),
        _Attribute("{Entity} crosses the {value} River.", "Which river does {entity} cross?", _Names.word),
        _Attribute("The bridge is {value} metres long.", "How many metres long is {entity}?", _number(40, 900)),
    )),
    "company": ("{name} Industries", "{Entity} is a manufacturer with a long history.", (
        _Attribute("{Entity} was founded in {value}.", "In which year was {entity} founded?", _year),
        _Attribute("Its founder was {value}.", "Who founded {entity}?", _Names.person),
        _Attribute("The company has its headquarters in {value}.", "Where does {entity} have its headquarters?",
                   _Names.word),
        _Attribute("It employs {value} people.", "How many people does {entity} employ?", _number(120, 9000)),
    )),
    "ship": ("the research ship {name}", "{Entity} studies the currents of the southern sea.", (
        _Attribute("{Entity} was launched in {value}.", "In which year was {entity} launched?", _year),
        _Attribute("Her captain is {value}.", "Who is the captain of {entity}?", _Names.person),
        _Attribute("Her home port is {value}.", "What is the home port of {entity}?", _Names.word),
        _Attribute("She carries a crew of {value}.", "How large is the crew of {entity}?", _number(12, 240)),
    )),
    "festival": ("the {name} Festival", "{Entity} is a summer music festival.", (
        _Attribute("{Entity} was first held in {value}.", "In which year was {entity} first held?", _year),
        _Attribute("It is organised by {value}.", "Who organises {entity}?", _Names.person),
        _Attribute("The festival takes place in the town of {value}.", "In which town does {entity} take place?",
                   _Names.word),
        _Attribute("It draws about {value} visitors.", "How many visitors does {entity} draw?",
                   _number(800, 90000)),
    )),
    "mountain": ("Mount {name}", "{Entity} is a peak in the eastern range.", (
        _Attribute("{Entity} was first climbed in {value}.", "In which year was {entity} first climbed?", _year),
        _Attribute("The first ascent was made by {value}.", "Who made the first ascent of {entity}?",
                   _Names.person),
        _Attribute("{Entity} rises above the {value} glacier.", "Which glacier does {entity} rise above?",
                   _Names.word),
        _Attribute("Its summit is {value} metres high.", "How high is the summit of {entity}, in metres?",
                   _number(1200, 8400)),
    )),
    "beetle": ("the {name} beetle", "{Entity} is a rare insect of the lowland forests.", (
        _Attribute("{Entity} was described in {value}.", "In which year was {entity} described?", _year),
        _Attribute("It was discovered by {value}.", "Who discovered {entity}?", _Names.person),
        _Attribute("It lives only in the {value} marshes.", "In which marshes does {entity} live?", _Names.word),
        _Attribute("It grows to {value} millimetres.", "How many millimetres does {entity} grow to?",
                   _number(3, 95)),
    )),
}  # fmt: skip


def _sentence(template: str, entity: str, value: str = "") -> str:
    return template.format(entity=entity, Entity=entity[0].upper() + entity[1:], value=value)


@dataclass(frozen=True)
class _Fact:
    block: Block
    questions: tuple[tuple[str, str], ...]  # (question, answer) per attribute


def _fact_corpus(rng: random.Random, per_kind: int) -> dict[str, list[_Fact]]:
    names = _Names(rng)
    corpus: dict[str, list[_Fact]] = {}
    for kind, (pattern, opening, attributes) in _KINDS.items():
        facts = []
        for index in range(per_kind):
            entity = pattern.format(name=names.word())
            values = [attribute.value(names) for attribute in attributes]
            said = [_sentence(a.statement, entity, v) for a, v in zip(attributes, values, strict=True)]
            rng.shuffle(said)
            text = " ".join([_sentence(opening, entity), *said])
            questions = tuple((_sentence(a.question, entity), v) for a, v in zip(attributes, values, strict=True))
            facts.append(_Fact(Block(id=f"{kind}-{index}", text=text), questions))
        corpus[kind] = facts
    return corpus


_RETRIEVER_JITTER = 0.15


def _facts(questions: int, seed: int, chat: bool, documents: int = 8) -> list[Question]:
    rng = random.Random(seed)
    corpus = _fact_corpus(rng, per_kind=14)
    everything = [fact.block for facts in corpus.values() for fact in facts]
    by_id = {fact.block.id: fact for facts in corpus.values() for fact in facts}
    out: list[Question] = []
    kinds = list(corpus)
    while len(out) < questions:
        kind = kinds[len(out) // (3 if chat else 1) % len(kinds)]
        number = len(out)
        if not chat:
            fact = rng.choice(corpus[kind])
            question, answer = rng.choice(fact.questions)
            blocks = bm25_rank(question, everything, documents, rng, _RETRIEVER_JITTER)
            out.append(Question(f"facts-{number}", tuple(blocks), question, (answer,), gold=fact.block.id))
            continue
        conversation = f"facts-chat-{number // 3}"
        asked: set[str] = set()
        shown: list[str] = []
        fact = rng.choice(corpus[kind])
        for turn in range(3):
            question, answer = rng.choice(fact.questions)
            blocks = bm25_rank(question, everything, documents, rng, _RETRIEVER_JITTER)
            out.append(Question(f"{conversation}-{turn}", tuple(blocks), question, (answer,), conversation,
                                fact.block.id))  # fmt: skip
            asked.add(fact.block.id)
            shown.extend(block.id for block in blocks if block.id not in shown)
            # the next turn asks about a document an earlier turn showed (of this kind: it comes back)
            later = [by_id[i] for i in shown if i not in asked and i.startswith(kind)]
            fact = rng.choice(later) if later else rng.choice(corpus[kind])
    return out[:questions]


# ---- memory snippets --------------------------------------------------------------------------------------
_MEMORY: tuple[tuple[str, str, str], ...] = (
    # (snippet, question, value kind)
    ("The user's sister lives in {v}.", "Where does the user's sister live?", "place"),
    ("The user's brother is called {v}.", "What is the name of the user's brother?", "person"),
    ("The user's dog is named {v}.", "What is the name of the user's dog?", "word"),
    ("The user's cat is named {v}.", "What is the name of the user's cat?", "word"),
    ("The user works at {v} Labs.", "At which company does the user work?", "word"),
    ("The user's manager is {v}.", "Who is the user's manager?", "person"),
    ("The user's dentist is {v}.", "Who is the user's dentist?", "person"),
    ("The user grew up in {v}.", "Where did the user grow up?", "place"),
    ("The user's favourite colour is {v}.", "What is the user's favourite colour?", "colour"),
    ("The user is allergic to {v}.", "What is the user allergic to?", "food"),
    ("The user's favourite dish is {v}.", "What is the user's favourite dish?", "food"),
    ("The user is learning to play the {v}.", "Which instrument is the user learning to play?", "instrument"),
    ("The user's next flight goes to {v}.", "Where does the user's next flight go?", "place"),
    ("The user's daughter studies {v}.", "What does the user's daughter study?", "subject"),
    ("The user's son plays for the {v} Rovers.", "Which team does the user's son play for?", "word"),
    ("The user's neighbour is {v}.", "Who is the user's neighbour?", "person"),
    ("The user's car is a {v}.", "What colour is the user's car?", "colour"),
    ("The user goes to the gym on {v}.", "On which day does the user go to the gym?", "day"),
    ("The user's best friend is {v}.", "Who is the user's best friend?", "person"),
    ("The user's landlord is {v}.", "Who is the user's landlord?", "person"),
    ("The user's mother lives in {v}.", "Where does the user's mother live?", "place"),
    ("The user's favourite author is {v}.", "Who is the user's favourite author?", "person"),
    ("The user's book club meets on {v}.", "On which day does the user's book club meet?", "day"),
    ("The user's bank is {v} Savings.", "What is the user's bank?", "word"),
    ("The user's piano teacher is {v}.", "Who is the user's piano teacher?", "person"),
    ("The user's parrot is named {v}.", "What is the name of the user's parrot?", "word"),
    ("The user's plumber is {v}.", "Who is the user's plumber?", "person"),
    ("The user's wedding was held in {v}.", "Where was the user's wedding held?", "place"),
    ("The user's favourite drink is {v}.", "What is the user's favourite drink?", "drink"),
    ("The user's grandfather was born in {v}.", "Where was the user's grandfather born?", "place"),
    ("The user's yoga class is on {v}.", "On which day is the user's yoga class?", "day"),
    ("The user's childhood friend is {v}.", "Who is the user's childhood friend?", "person"),
    ("The user's boat is called {v}.", "What is the user's boat called?", "word"),
    ("The user's doctor is {v}.", "Who is the user's doctor?", "person"),
    ("The user's cousin lives in {v}.", "Where does the user's cousin live?", "place"),
    ("The user's lawyer is {v}.", "Who is the user's lawyer?", "person"),
    ("The user's horse is named {v}.", "What is the name of the user's horse?", "word"),
    ("The user's uncle is called {v}.", "What is the name of the user's uncle?", "person"),
    ("The user's tennis partner is {v}.", "Who is the user's tennis partner?", "person"),
    ("The user's aunt lives in {v}.", "Where does the user's aunt live?", "place"),
)
_VALUES = {
    "colour": ("red", "green", "blue", "yellow", "purple", "orange", "grey", "white", "black", "brown"),
    "food": ("peanuts", "shellfish", "lentil soup", "mushroom risotto", "plum cake", "sesame", "rye bread",
             "goat cheese", "apricots", "dumplings"),
    "instrument": ("cello", "oboe", "banjo", "harp", "trumpet", "accordion", "violin", "flute", "drums", "sitar"),
    "subject": ("geology", "law", "linguistics", "chemistry", "architecture", "medicine", "history", "music",
                "botany", "economics"),
    "day": ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"),
    "drink": ("mint tea", "black coffee", "ginger beer", "lemonade", "cocoa", "green tea", "cider", "milk"),
}  # fmt: skip


def _memory(questions: int, seed: int, chat: bool, snippets: int = 20, per_user: int = 40) -> list[Question]:
    rng = random.Random(seed)
    names = _Names(rng)
    out: list[Question] = []
    user = 0
    while len(out) < questions:
        facts = rng.sample(_MEMORY, min(per_user, len(_MEMORY)))
        blocks, asked = [], []
        for index, (snippet, question, kind) in enumerate(facts):
            value = (
                names.person() if kind == "person"
                else names.word() if kind in ("place", "word")
                else rng.choice(_VALUES[kind])
            )  # fmt: skip
            blocks.append(Block(id=f"user{user}-{index}", text=snippet.format(v=value)))
            asked.append((question, value))
        conversation = f"memory-chat-{user}" if chat else None
        shown: list[int] = []
        pick = rng.randrange(len(facts))
        for turn in range(3 if chat else 4):
            question, value = asked[pick]
            retrieved = bm25_rank(question, blocks, snippets, rng, _RETRIEVER_JITTER)
            qid = f"{conversation}-{turn}" if chat else f"memory-{user}-{turn}"
            out.append(Question(qid, tuple(retrieved), question, (value,), conversation, blocks[pick].id))
            shown.extend(blocks.index(b) for b in retrieved if blocks.index(b) not in shown)
            later = [i for i in shown if i != pick] if chat else list(range(len(facts)))
            pick = rng.choice(later)
        user += 1
    return out[:questions]


# ---- the bundled MultiHop-RAG sample ----------------------------------------------------------------------
def _multihop(questions: int, seed: int, chat: bool, documents: int = 3) -> list[Question]:
    from ..datasets import load_multihop_rag

    data = load_multihop_rag()
    chosen = [q for q in data.queries if q.question_type == "inference_query"]
    random.Random(seed).shuffle(chosen)
    return [
        Question(f"multihop-{q.qid}", tuple(data.blocks_for(q)[:documents]), q.text, (q.answer,))
        for q in chosen[:questions]
    ]


WORKLOADS: dict[str, tuple[Callable[[int, int, bool], list[Question]], bool, str]] = {
    "facts": (_facts, False, "fact lookup, 8 documents of ~60 tokens a question"),
    "facts-chat": (_facts, True, "3-turn conversations; later turns ask about documents an earlier turn sent"),
    "memory": (_memory, False, "a user's memory: 20 snippets of ~15 tokens a question"),
    "memory-chat": (_memory, True, "3-turn conversations over a user's memory snippets"),
    "multihop": (_multihop, False, "MultiHop-RAG inference questions, their BM25 top 3 news chunks (~800 tokens)"),
}
"""name -> (generator, whether it is conversations, description)."""


def workload(name: str, questions: int, seed: int = 0) -> list[Question]:
    """``questions`` questions of the workload ``name`` (:data:`WORKLOADS`), the same for
    the same seed."""
    if name not in WORKLOADS:
        raise WorkloadError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    if questions < 1:
        raise WorkloadError(f"questions must be at least 1, got {questions}")
    make, chat, _ = WORKLOADS[name]
    return make(questions, seed, chat)
