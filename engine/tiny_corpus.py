"""The tiny models' tokenizer corpus: generated here, so it is the same on every machine and Python version.

`corpus_texts` returns English-like prose, Python/JavaScript/C/JSON/shell-like code, CJK text with emoji,
and a few fixed multilingual lines. Only integer arithmetic drives it (`SplitMix64` below), never
`random`, `hash()` or set order. Any change to what it returns changes the tiny models' tokenizers:
bump `engine.tiny.FORMAT_VERSION` and the pins in tests/test_tiny_pins.py.
"""

from __future__ import annotations

from collections.abc import Sequence

# Multi-byte text, repeated so that BPE learns merges inside CJK characters and emoji.
MULTILINGUAL_LINES = (
    "你好，世界！今天的天气很好，我们去公园散步吧。",
    "模型在服务器上运行，预填充节点和解码节点分开部署。",
    "東京は日本の首都です。ラーメンが大好きです。",
    "안녕하세요, 만나서 반갑습니다.",
    "Привет, мир! Как дела?",
    "Café, naïve, résumé, façade, jalapeño, Straße.",
    "Emoji: 😀 😂 🚀 ✨ 👍🏽 🎉 ❤️ 🐍 🌍",
    "数学：∑ x² = ∫ f(x) dx ≈ 3.14159 ± 0.001 → ∞",
)
MULTILINGUAL_REPEATS = 8

CORPUS_SEED = 20240611
ENGLISH_DOCS = 700
CODE_DOCS = 500
CJK_DOCS = 120

NOUNS = (
    "time year people way day man woman child world life hand part place case week company system program "
    "question work government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend father power hour game "
    "line end member law car city community name president team minute idea kid body information back parent "
    "face others level office door health person art war history party result change morning reason research "
    "girl guy moment air teacher force education foot boy age policy music market sense nation plan college "
    "interest death experience effect class control care field development role effort rate heart drug show "
    "leader light voice wife police mind price report decision son view relationship town road arm difference "
    "value building action model season society tax director position player record paper space ground form "
    "event official matter center couple site project activity star table need court oil situation cost "
    "industry figure street image phone data picture practice piece land product doctor wall patient worker "
    "news test movie north love support technology step baby computer type attention film tree source "
    "organization hair window evidence population site garden river ocean mountain forest island village "
    "kitchen bridge engine server client request response cache token model prompt layer kernel memory disk "
    "network packet socket thread process queue buffer stream signal message channel router gateway cluster "
    "node pool batch block table index schema record field column query store shard replica leader follower "
    "fox dog cat horse bird fish apple bread coffee tea letter ticket train station airport weather sky "
    "cloud rain snow wind sun moon planet journey castle dragon king queen princess knight wizard forest"
).split()
VERBS = (
    "be have do say go get make know think take see come want look use find give tell work call try ask "
    "need feel become leave put mean keep let begin seem help talk turn start show hear play run move like "
    "live believe hold bring happen write provide sit stand lose pay meet include continue set learn change "
    "lead understand watch follow stop create speak read allow add spend grow open walk win offer remember "
    "consider appear buy wait serve die send expect build stay fall cut reach kill remain suggest raise pass "
    "sell require report decide pull return explain hope develop carry break receive agree support hit "
    "produce eat cover catch draw choose cause point listen realize place close involve increase compute "
    "load save parse encode decode schedule allocate release measure restart deploy scale route retry"
).split()
PAST = (
    "was had did said went got made knew thought took saw came wanted looked used found gave told worked "
    "called tried asked needed felt became left put meant kept let began seemed helped talked turned started "
    "showed heard played ran moved liked lived believed held brought happened wrote provided sat stood lost "
    "paid met included continued learned changed led understood watched followed stopped created spoke read "
    "allowed added spent grew opened walked won offered remembered considered appeared bought waited served "
    "sent expected built stayed fell reached remained suggested raised passed sold required reported decided "
    "returned explained hoped developed carried broke received agreed produced ate covered caught drew chose"
).split()
ADJECTIVES = (
    "good new first last long great little own other old right big high different small large next early "
    "young important few public bad same able free sure clear recent full special whole strong certain "
    "real late hard simple easy quick brown lazy bright dark cold warm quiet loud happy sad strange "
    "beautiful small fast slow heavy light empty busy safe careful ready local remote private stable "
    "correct wrong final main single double deep short wide narrow green blue red yellow white black"
).split()
ADVERBS = (
    "also just only very even back there still well here then now often never always really almost "
    "together already quickly slowly finally suddenly usually actually probably clearly simply carefully"
).split()
GREETINGS = ("Hello", "Hi", "Hey", "Thanks", "Thank you", "Good morning", "Welcome back", "Sorry", "Dear")
PREPOSITIONS = "in on at by for with from into over under after before about through between across near".split()
DETERMINERS = "the a this that every each some another our their his her its my your".split()
NAMES = (
    "Alice Bob Carol David Emma Frank Grace Henry Iris Jack Karen Leo Maria Noah Olivia Peter Quinn Rosa "
    "Sam Tina Uma Victor Wendy Xavier Yara Zoe London Paris Berlin Tokyo Madrid Cairo Lima Oslo Seattle"
).split()
PSEUDO_ONSETS = "b c d f g h j k l m n p r s t v w z br cr dr fl gr pl pr sh st th tr ch".split()
PSEUDO_VOWELS = "a e i o u ai ea ee io oo ou".split()
PSEUDO_CODAS = ("", "", "n", "r", "s", "l", "m", "nd", "st", "rk", "th", "ng")

PY_KEYWORDS_TYPES = ("int", "str", "float", "bool", "bytes", "list[int]", "dict[str, int]", "None", "Path")
CODE_OPERATORS = ("+", "-", "*", "//", "%", "<<", ">>", "&", "|", "^")
CODE_COMPARISONS = ("<", "<=", ">", ">=", "==", "!=")

CJK_WORDS = (
    "我们 你们 他们 今天 明天 昨天 时间 问题 工作 学习 服务 模型 推理 请求 响应 节点 集群 缓存 网络 数据 "
    "系统 用户 文本 输出 输入 调度 批处理 延迟 吞吐 内存 显卡 部署 监控 日志 错误 重试 超时 队列 负载 "
    "天气 公园 散步 城市 朋友 老师 学生 电脑 手机 音乐 电影 早上 晚上 喜欢 需要 可以 已经 因为 所以 "
    "東京 大阪 日本 学校 先生 言葉 料理 電車 時間 世界 今日 明日 ありがとう こんにちは おはよう すみません "
    "サーバー モデル データ キャッシュ 안녕하세요 감사합니다 서버 모델 데이터 사용자"
).split()
CJK_PUNCT = ("，", "。", "！", "？", "、", "：")
EMOJI = ("😀", "😂", "🚀", "✨", "👍", "👍🏽", "🎉", "❤️", "🐍", "🌍", "🔥", "💡", "✅", "⚠️", "📦", "🙂")


class SplitMix64:
    """Tiny seeded PRNG (Steele, Lea & Flood's SplitMix64) on Python integers: the same stream on every
    platform and Python version, unlike `random`, whose algorithms are not a compatibility promise."""

    MASK = (1 << 64) - 1

    def __init__(self, seed: int) -> None:
        self.state = seed & self.MASK

    def next(self) -> int:
        """Advances the state and returns the next 64-bit output."""
        self.state = (self.state + 0x9E3779B97F4A7C15) & self.MASK
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & self.MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & self.MASK
        return z ^ (z >> 31)

    def below(self, n: int) -> int:
        """An integer in [0, n) (multiply-shift: the bias for small n is irrelevant here)."""
        return (self.next() * n) >> 64

    def choice(self, seq: Sequence[str]) -> str:
        return seq[self.below(len(seq))]

    def chance(self, percent: int) -> bool:
        return self.below(100) < percent


def _pseudo_word(rng: SplitMix64) -> str:
    """A pronounceable made-up word: distinct words give the BPE trainer more than a word list's merges."""
    return "".join(rng.choice(PSEUDO_ONSETS) + rng.choice(PSEUDO_VOWELS) + PSEUDO_CODAS[rng.below(len(PSEUDO_CODAS))]
                   for _ in range(1 + rng.below(3)))


def _plural(noun: str) -> str:
    if noun.endswith(("s", "x", "ch", "sh")):
        return noun + "es"
    if noun.endswith("y") and noun[-2] not in "aeiou":
        return noun[:-1] + "ies"
    return noun + "s"


def _name(rng: SplitMix64) -> str:
    return rng.choice(NAMES) if rng.chance(70) else _pseudo_word(rng).capitalize()


def _noun_phrase(rng: SplitMix64) -> str:
    words = [rng.choice(DETERMINERS)]
    if rng.chance(45):
        words.append(rng.choice(ADJECTIVES))
    noun = rng.choice(NOUNS)
    words.append(_plural(noun) if rng.chance(25) else noun)
    if rng.chance(20):
        words += [rng.choice(PREPOSITIONS), _name(rng)]
    return " ".join(words)


def _clause(rng: SplitMix64) -> str:
    subject = _name(rng) if rng.chance(35) else _noun_phrase(rng)
    kind = rng.below(4)
    if kind == 0:
        return f"{subject} {rng.choice(PAST)} {_noun_phrase(rng)}"
    if kind == 1:
        return f"{subject} {rng.choice(ADVERBS)} {rng.choice(PAST)} {rng.choice(PREPOSITIONS)} {_noun_phrase(rng)}"
    if kind == 2:
        return f"{subject} was {rng.choice(ADVERBS)} {rng.choice(ADJECTIVES)}"
    return f"{subject} will {rng.choice(VERBS)} {_noun_phrase(rng)} {rng.choice(PREPOSITIONS)} {_noun_phrase(rng)}"


def _sentence(rng: SplitMix64) -> str:
    kind = rng.below(10)
    if kind == 8:
        text = f"{rng.choice(GREETINGS)}, {_name(rng)}! {_clause(rng).capitalize()}."
    elif kind == 9:
        text = f"Once upon a time, {_clause(rng)}."
    elif kind == 0:
        text = f"How do I {rng.choice(VERBS)} {_noun_phrase(rng)} {rng.choice(PREPOSITIONS)} {_noun_phrase(rng)}?"
    elif kind == 1:
        text = f"In {1800 + rng.below(226)}, {_clause(rng)} and {_clause(rng)}."
    elif kind == 2:
        text = f"\"{_clause(rng).capitalize()}!\" said {_name(rng)}."
    elif kind == 3:
        text = f"If you {rng.choice(VERBS)} {_noun_phrase(rng)}, {_clause(rng)}."
    elif kind == 4:
        n = rng.below(10_000) if rng.chance(50) else rng.below(100)
        text = f"{_clause(rng)} with {n} {_plural(rng.choice(NOUNS))}, about {rng.below(100)}.{rng.below(10)}% of them."
    elif kind == 5:
        text = f"{_clause(rng)}; {_clause(rng)}."
    else:
        text = f"{_clause(rng)}, {rng.choice(('but', 'and', 'so', 'because', 'while'))} {_clause(rng)}."
    return text[0].upper() + text[1:]


def _english_document(rng: SplitMix64) -> str:
    """A few paragraphs of English-like prose, sometimes with a Markdown title or list."""
    parts = []
    if rng.chance(30):
        parts.append(f"{'#' * (1 + rng.below(3))} {_noun_phrase(rng).title()}")
    for _ in range(1 + rng.below(4)):
        if rng.chance(15):
            bullet = rng.choice(("-", "*", "1."))
            parts.append("\n".join(f"{bullet} {_sentence(rng)}" for _ in range(2 + rng.below(3))))
        else:
            parts.append(" ".join(_sentence(rng) for _ in range(2 + rng.below(5))))
    return "\n\n".join(parts) + "\n"


def _snake(rng: SplitMix64) -> str:
    return "_".join(rng.choice(VERBS if i == 0 and rng.chance(50) else NOUNS) for i in range(1 + rng.below(3)))


def _camel(rng: SplitMix64) -> str:
    return "".join(rng.choice(NOUNS).capitalize() for _ in range(1 + rng.below(2))) + rng.choice(
        ("", "Config", "Manager", "Error", "Client", "Server", "Handler", "State", "Pool", "Reader"))


def _value(rng: SplitMix64, names: list[str]) -> str:
    kind = rng.below(7)
    if kind == 0:
        return str(rng.below(1 << (4 * (1 + rng.below(5)))))
    if kind == 1:
        return f"\"{rng.choice(NOUNS)} {rng.choice(NOUNS)}\""
    if kind == 2:
        return f"{rng.choice(names)} {rng.choice(CODE_OPERATORS)} {rng.below(64)}"
    if kind == 3:
        return f"{_snake(rng)}({', '.join(rng.choice(names) for _ in range(rng.below(3)))})"
    if kind == 4:
        return f"[{rng.choice(names)} for {rng.choice(names)} in {rng.choice(names)}]"
    if kind == 5:
        return f"f\"{rng.choice(NOUNS)}={{{rng.choice(names)}}}\""
    return f"{rng.choice(names)}.{_snake(rng)}"


def _python_block(rng: SplitMix64, names: list[str], indent: str, depth: int) -> list[str]:
    lines = []
    for _ in range(1 + rng.below(4)):
        kind = rng.below(9 if depth < 2 else 4)
        name = rng.choice(names)
        if kind == 0:
            new = _snake(rng)
            names.append(new)
            lines.append(f"{indent}{new} = {_value(rng, names)}")
        elif kind == 1:
            lines.append(f"{indent}{name} {rng.choice(CODE_OPERATORS)}= {rng.below(100)}")
        elif kind == 2:
            lines.append(f"{indent}# {_sentence(rng)}")
        elif kind == 3:
            lines.append(f"{indent}{_snake(rng)}({name}, {_snake(rng)}={_value(rng, names)})")
        elif kind == 4:
            lines.append(f"{indent}if {name} {rng.choice(CODE_COMPARISONS)} {rng.below(1000)}:")
            lines += _python_block(rng, names, indent + "    ", depth + 1)
            if rng.chance(40):
                lines.append(f"{indent}else:")
                lines += _python_block(rng, names, indent + "    ", depth + 1)
        elif kind == 5:
            var = rng.choice(("i", "j", "k", "item", "key", "row"))
            lines.append(f"{indent}for {var} in range({rng.choice(names)}):")
            lines += _python_block(rng, [*names, var], indent + "    ", depth + 1)
        elif kind == 6:
            lines.append(f"{indent}try:")
            lines += _python_block(rng, names, indent + "    ", depth + 1)
            lines.append(f"{indent}except {_camel(rng)}Error as exc:")
            lines.append(f"{indent}    raise ValueError(f\"{rng.choice(NOUNS)} {{exc}}\") from exc")
        elif kind == 7:
            lines.append(f"{indent}while {name} and not {_snake(rng)}:")
            lines += _python_block(rng, names, indent + "    ", depth + 1)
        else:
            lines.append(f"{indent}with open({name}, \"{rng.choice(('r', 'rb', 'w'))}\") as f:")
            lines.append(f"{indent}    {_snake(rng)} = f.read()")
    if lines[-1].lstrip().startswith("#"):  # a block of only comments is not Python
        lines.append(f"{indent}pass")
    return lines


def _python_function(rng: SplitMix64, indent: str = "", method: bool = False) -> list[str]:
    args = [_snake(rng) for _ in range(rng.below(4))]
    params = ["self"] if method else []
    params += [f"{a}: {rng.choice(PY_KEYWORDS_TYPES)}" for a in args]
    lines = [f"{indent}def {_snake(rng)}({', '.join(params)}) -> {rng.choice(PY_KEYWORDS_TYPES)}:",
             f"{indent}    \"\"\"{_sentence(rng)}\"\"\""]
    names = args or ["value"]
    lines += _python_block(rng, names, indent + "    ", 0)
    lines.append(f"{indent}    return {rng.choice(names)}")
    return lines


def _js_function(rng: SplitMix64) -> list[str]:
    a, b = _camel(rng)[0].lower() + _camel(rng)[1:], rng.choice(NOUNS)
    fn = rng.choice(VERBS) + _camel(rng)
    return [
        f"function {fn}({a}, {b}) {{",
        f"  const {rng.choice(NOUNS)} = {a} {rng.choice(CODE_OPERATORS)} {b};",
        f"  if ({a} {rng.choice(CODE_COMPARISONS)} {rng.below(100)}) {{",
        f"    return {fn}({a} - 1, {b});",
        "  }",
        f"  console.log(`{rng.choice(NOUNS)}: ${{{b}}}`);",
        f"  return {{ {a}, {b}: {rng.below(1000)} }};",
        "}",
    ]


def _c_function(rng: SplitMix64) -> list[str]:
    fn, n = _snake(rng), rng.choice(NOUNS)
    return [
        f"static int {fn}(const int *{n}, size_t len) {{",
        "    int total = 0;",
        "    for (size_t i = 0; i < len; i++) {",
        f"        total += {n}[i] {rng.choice(CODE_OPERATORS)} {rng.below(256)};",
        "    }",
        "    return total;",
        "}",
    ]


def _json_object(rng: SplitMix64) -> list[str]:
    fields = [f"\"{_snake(rng)}\": {_value(rng, ['0'])}" if rng.chance(30) else
              f"\"{rng.choice(NOUNS)}\": {rng.choice(('true', 'false', 'null', str(rng.below(10_000))))}"
              for _ in range(2 + rng.below(4))]
    return ["{", *(f"  {f}," for f in fields[:-1]), f"  {fields[-1]}", "}"]


def _code_document(rng: SplitMix64) -> str:
    """A source file: mostly Python (imports, functions, a class), sometimes JavaScript, C, JSON or a shell
    session."""
    kind = rng.below(10)
    if kind < 6:
        lines = [f"from {_snake(rng)} import {_camel(rng)}", f"import {rng.choice(NOUNS)}", ""]
        for _ in range(1 + rng.below(2)):
            lines += ["", *_python_function(rng), ""]
        if rng.chance(50):
            lines += ["", f"class {_camel(rng)}:", f"    \"\"\"{_sentence(rng)}\"\"\"", "",
                      f"    def __init__(self, {rng.choice(NOUNS)}: int = {rng.below(100)}) -> None:",
                      f"        self.{_snake(rng)} = {rng.choice(NOUNS)}", "",
                      *_python_function(rng, "    ", method=True)]
    elif kind == 6:
        lines = _js_function(rng)
    elif kind == 7:
        lines = ["#include <stddef.h>", "", *_c_function(rng)]
    elif kind == 8:
        lines = _json_object(rng)
    else:
        lines = [f"$ pdserve {rng.choice(VERBS)} --{rng.choice(NOUNS)} {rng.below(16)} --{_snake(rng)}",
                 f"[pdserve] {_sentence(rng)}", f"$ ls {rng.choice(NOUNS)}/", f"{_snake(rng)}.py  README.md"]
    return "\n".join(lines) + "\n"


def _cjk_document(rng: SplitMix64) -> str:
    """A few short CJK sentences with the odd English word and emoji."""
    sentences = []
    for _ in range(2 + rng.below(4)):
        words = [rng.choice(CJK_WORDS) for _ in range(3 + rng.below(6))]
        if rng.chance(25):
            words.insert(rng.below(len(words)), f" {rng.choice(NOUNS)} ")
        if rng.chance(35):
            words.append(" " + rng.choice(EMOJI))
        sentences.append("".join(words) + rng.choice(CJK_PUNCT))
    return "".join(sentences) + "\n"


def corpus_texts() -> list[str]:
    """The training texts, in a fixed order: generated English, code and CJK documents, then the
    multilingual lines. A pure function of the constants above."""
    rng = SplitMix64(CORPUS_SEED)
    texts = [_english_document(rng) for _ in range(ENGLISH_DOCS)]
    texts += [_code_document(rng) for _ in range(CODE_DOCS)]
    texts += [_cjk_document(rng) for _ in range(CJK_DOCS)]
    texts.extend(list(MULTILINGUAL_LINES) * MULTILINGUAL_REPEATS)
    return texts

