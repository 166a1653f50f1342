"""Effect classes, digests and the gate's verdicts: table-driven, pure."""

from __future__ import annotations

from pathlib import Path

import pytest

from mars_openhands.runtime.effects import (
    Action,
    EffectClass,
    EffectRule,
    classify,
    idempotency_key,
)
from mars_openhands.runtime.gate import Verdict, decide
from mars_openhands.runtime.guard import check_command
from mars_openhands.runtime.metrics import _percentile, duplicate_effects, summarize
from mars_openhands.runtime.task import PermissionScope, TaskSpec

WS = Path("/tmp/mars-ws")
R, I, C, L, X = (EffectClass.READ, EffectClass.IDEMPOTENT_WRITE,  # noqa: E741 (classes by initial)
                 EffectClass.COMPENSABLE_WRITE, EffectClass.LOCAL_WRITE, EffectClass.IRREVERSIBLE)

TERMINAL = [
    ("ls -la", R, False), ("cat a.py | grep foo", R, False), ("git diff HEAD~1", R, False),
    ("git status && git log -3", R, False), ("sed -n 1,5p a.py", R, False),
    ("echo hi > out.txt", I, False), ("sed -i s/a/b/ a.py", L, False), ("python -m pytest -q", I, False),
    ("rm -rf build", I, False),
    ("git commit -qam fix", C, False), ("git add . && git commit -m x", C, False),
    ("git commit -m a && git commit -m b", X, False),  # two undo commands: not compensable
    ("git push origin main", X, True), ("curl -X POST http://h/x", X, True),
    ("curl -s -d 'a=1' http://h/x", X, True), ("npm publish", X, True), ("ssh host ls", X, True),
    ('curl -X PUT -H "Idempotency-Key: $MARS_IDEMPOTENCY_KEY" http://h/x', I, True),
    ("curl -s http://h/x", R, True), ("rm -rf /etc/x", X, False), ("cp a ../b", X, False),
    # installs and fetches reach the network (a scope without `network` denies them)
    ("pip install requests", L, True), ("python -m pip install -e .", L, True), ("npm ci", L, True),
    ("uv pip install x", L, True), ("uv sync", L, True), ("yarn", L, True), ("go get x", L, True),
    ("cargo fetch", L, True), ("git clone https://h/r", L, True), ("git pull", L, True),
    ("git ls-remote origin", R, True), ("npm run build", L, False), ("git log", R, False),
    # queries of what is installed are reads; of the package index, network reads
    ("pip list", R, False), ("python -m pip show requests", R, False), ("pip freeze > req.txt", I, False),
    ("npm ls", R, False), ("python --version", R, False), ("pip index versions x", R, True),
    ("npm view react version", R, True), ("pip list && pip install x", L, True),
]


@pytest.mark.parametrize(("command", "effect", "is_network"), TERMINAL)
def test_terminal_commands_get_their_class(command: str, effect: EffectClass, is_network: bool) -> None:
    got = classify(Action.build("terminal", {"command": command}, WS), WS)
    assert (got.effect, got.is_network) == (effect, is_network), got


def test_file_editor_and_other_tools() -> None:
    def effect(tool: str, **args: object) -> EffectClass:
        return classify(Action.build(tool, args, WS), WS).effect

    assert effect("file_editor", command="view", path="a.py") == R
    assert effect("file_editor", command="create", path="a.py", file_text="x") == I
    assert effect("file_editor", command="str_replace", path="/etc/hosts", old_str="a", new_str="b") == X
    assert effect("task_tracker", command="plan") == R
    assert effect("browser", command="click") == X  # unknown tools are irreversible


def test_compensable_write_carries_its_undo() -> None:
    got = classify(Action.build("terminal", {"command": "git commit -qm x"}, WS), WS)
    assert got.probe == "git rev-parse HEAD" and got.compensation == "git reset --soft {before}"


def test_task_rules_come_first() -> None:
    rules = (EffectRule(name="deploy", pattern=r"^make\s+deploy\b", effect=X, is_network=True),)
    action = Action.build("terminal", {"command": "make deploy"}, WS)
    assert classify(action, WS, rules).effect == X
    assert classify(action, WS).effect == L  # an unknown program: not provably idempotent
    mine = (EffectRule(name="tests", pattern=r"^\./run_tests\.sh\b", effect=I),)
    tests = Action.build("terminal", {"command": "./run_tests.sh -q"}, WS)
    assert classify(tests, WS).effect == L
    assert classify(tests, WS, mine).effect == I  # a task may declare its test command repeatable
    appended = Action.build("terminal", {"command": "./run_tests.sh -q >> runs.log"}, WS)
    assert classify(appended, WS, mine).effect == L  # ... but not an append of its output


# Is a repeat of the command (after a crash left it in doubt) provably a no-op? Only then is it an
# idempotent write, re-run on its own; a local write (inside the workspace) escalates instead.
REPEAT_SAFETY = [
    # appends: every repeat adds again
    ("echo one >> log.txt; sleep 8", L), ("echo one>>log.txt", L), ("printf 'x\\n' >> f", L),
    ("pytest &>> out.log", L), ("ls 2>> err.log", L), ("cat a | tee -a log", L),
    ("cat a | tee --append log", L), ("git diff >> all.patch", L),
    # `>` replaces the file: idempotent only if what is written is the same on every run
    ("echo hi > out.txt", I), ("echo hi>out.txt", I), ("cat a | sort > b", I), ("sed -n 1,5p a > b", I),
    ("git diff > a.patch", I), ("echo x | tee f", I), ("> empty.txt", I), ("echo x >| f", I),
    ("date > stamp", L), ("echo $RANDOM > r", L), ("echo $(date) > f", L), ("echo `date` > f", L),
    ("ls -l > listing", L), ("curl -s http://h/x > page", L), ("head -c 8 /dev/urandom > key", L),
    ("python gen.py > out.txt", L),
    # writing commands: the same state (and exit status) on a repeat, or not
    ("mkdir -p a/b", I), ("mkdir --parents a", I), ("mkdir a", L), ("rm -f a.txt", I), ("rm -rf build", I),
    ("rm a.txt", L), ("rm -r build", L), ("rmdir d", L), ("mv a b", L), ("cp a b", I), ("cp -r src dst", L),
    ("cp -a src dst", L), ("touch a", I), ("chmod +x run.sh", I), ("ln -s a b", L), ("ln -sf dir link", L),
    ("ln -sfn dir link", I), ("ln -f a b", I), ("truncate -s 0 f", L), ("dd if=a of=b", L),
    ("sed -i s/a/b/ a.py", L), ("sed -i '$a line' a.py", L), ("sed --in-place s/a/b/ a.py", L),
    ("find . -name '*.py' -exec sed -i s/a/b/ {} +", L), ("find . -name x -delete", L), ("sort -o f f", L),
    ("awk '{print > \"out\"}' f", L),
    # reads whose options or scripts name a written file: the file is replaced by the same output
    ("uniq in out", I), ("uniq -f 1 in out", I), ("sed -n '1,5w part' f", I), ("sed 's/a/b/w changed' f", I),
    ("sort -ro out f", L), ("curl -so page http://h/x", L),
    # sed scripts that run commands (GNU `e`, `s///e`) or come from a file the runtime cannot read
    ("sed '1e touch x' f", L), ("sed 's/.*/date/e' f", L), ("sed -f fix.sed f", L), ("sed -nf fix.sed f", L),
    ("sed --sandbox -n 2p f", R), ("sed 's/e/E/' f", R), ("sed '/w/d' f", R), ("sed 's/wrong/right/g' f", R),
    ("sed '1a w x' f", R), ("sed 'r other' f", R), ("uniq -c f", R), ("sort -r f", R),
    # git: history edits and branch creation act again or fail on a repeat
    ("git add -A", I), ("git checkout main", I), ("git restore a.py", I), ("git init -q", I),
    ("git commit -qm x", C), ("git checkout -b feature", L), ("git switch -c feature", L),
    ("git stash", L), ("git stash pop", L), ("git merge other", L), ("git rebase main", L),
    ("git cherry-pick abc", L), ("git apply fix.patch", L), ("git mv a b", L), ("git rm a", L),
    ("git tag v1", L), ("git reset --hard HEAD~1", L), ("git commit -qm x && echo done >> log", L),
    # package installs and unknown programs: the runtime cannot see what they write
    ("pip install requests", L), ("python -m pip install -e .", L), ("npm install", L), ("npm ci", L),
    ("uv pip install x", L), ("cargo build", L), ("make", L), ("python -c 'print(1)'", L), ("./run.sh", L),
    ("make install", L), ("make test && make install", L), ("npm run build", L),
    # test runners: repeatable by design (a default rule), unless their output is appended
    ("pytest -q tests/", I), ("python -m pytest -x", I), ("python3 -m unittest", I), ("go test ./...", I),
    ("cargo test", I), ("npm test", I), ("yarn run test", I), ("make test", I), ("tox", I),
    ("pytest -q > out.txt", I), ("pytest &>> out.log", L),
    # plain reads stay reads (output to the terminal or /dev/null, descriptors duplicated)
    ("ls -la", R), ("ls 2>/dev/null", R), ("grep -rn foo . 2>&1 | head -20", R), ("cat a > /dev/null", R),
    ("git status 2>&1", R), ("git log --oneline -5", R), ("git show HEAD:a.py", R), ("git branch", R),
    ("git stash list", R), ("git describe --tags", R), ("awk '{print $1}' f", R), ("sed -n 2p f", R),
    ("find . -name '*.py'", R), ("sort f | uniq -c", R), ("jq .name package.json", R), ("tee", R),
    ("sha256sum a", R), ("", R), ("cd src && ls", R), ("diff a b", R), ("echo $HOME", R),
]


@pytest.mark.parametrize(("command", "effect"), REPEAT_SAFETY)
def test_only_provably_idempotent_writes_are_idempotent(command: str, effect: EffectClass) -> None:
    got = classify(Action.build("terminal", {"command": command}, WS), WS)
    assert got.effect == effect, got


def test_local_write_escalates_and_is_not_retried_but_runs_without_approval() -> None:
    assert not L.is_repeatable and not X.is_repeatable and not C.is_repeatable
    assert R.is_repeatable and I.is_repeatable
    assert L.risk > C.risk  # `git commit && echo >> log`: no undo-and-repeat for the line
    action = Action.build("terminal", {"command": "echo one >> log.txt"}, WS)
    assert decide(action, classify(action, WS), PermissionScope(), WS).verdict == Verdict.ALLOW


@pytest.mark.parametrize(("allowed", "approval", "expected"), [
    (("read", "idempotent_write", "compensable_write"), ("irreversible",), (R, I, C, L)),
    (("read",), ("irreversible",), (R,)),
    (("read", "idempotent_write"), ("local_write", "irreversible"), (R, I)),
])
def test_old_scopes_that_allow_idempotent_writes_allow_local_writes(
        allowed: tuple[str, ...], approval: tuple[str, ...], expected: tuple[EffectClass, ...]) -> None:
    """Before local_write existed its commands were idempotent writes: a task file's scope keeps
    its meaning, unless it names local_write itself."""
    scope = PermissionScope.model_validate({"allowed_effects": allowed, "approval_effects": approval})
    assert scope.allowed_effects == expected


def test_digest_binds_tool_arguments_and_target() -> None:
    base = Action.build("terminal", {"command": "curl -X POST http://h/x", "summary": "s1"}, WS)
    same = Action.build("terminal", {"command": "curl -X POST http://h/x", "summary": "other words"}, WS)
    assert base.digest() == same.digest() and len(base.digest()) == 64  # volatile fields ignored
    assert base.target == f"shell:{WS} http://h/x"
    changed = Action.build("terminal", {"command": "curl -X POST http://h/y"}, WS)
    elsewhere = Action.build("terminal", {"command": "curl -X POST http://h/x"}, Path("/tmp/other"))
    assert len({base.digest(), changed.digest(), elsewhere.digest()}) == 3
    assert idempotency_key("t", 7, base.digest()) == f"t/7/{base.digest()[:16]}"


GATE = [
    ("ls", PermissionScope(), Verdict.ALLOW, "scope.effects"),
    ("git push", PermissionScope(network=True), Verdict.NEEDS_APPROVAL, "scope.effects"),
    ("git push", PermissionScope(), Verdict.DENY, "scope.network"),
    ("sudo ls", PermissionScope(), Verdict.DENY, "guard.privilege_escalation"),
    ("echo x > /opt/out/f", PermissionScope(), Verdict.DENY, "guard.write_outside_workspace"),
    ("echo x > /opt/out/f", PermissionScope(guard=False), Verdict.DENY, "scope.paths"),
    ("echo x > /opt/out/f", PermissionScope(workspace_paths=("/opt/out",)), Verdict.ALLOW, "scope.effects"),
    ("git commit -m x", PermissionScope(allowed_effects=(R, I)), Verdict.DENY, "scope.effects"),
    ("git commit -m x", PermissionScope(allowed_effects=(R,), approval_effects=(C, X)),
     Verdict.NEEDS_APPROVAL, "scope.effects"),
]


@pytest.mark.parametrize(("command", "scope", "verdict", "rule"), GATE)
def test_gate_verdicts(command: str, scope: PermissionScope, verdict: Verdict, rule: str) -> None:
    action = Action.build("terminal", {"command": command}, WS)
    decision = decide(action, classify(action, WS, extra_roots=[Path(p) for p in scope.workspace_paths]),
                      scope, WS)
    assert (decision.verdict, decision.rule) == (verdict, rule), decision
    assert decision.reason


def test_scope_rejects_a_class_in_both_lists() -> None:
    with pytest.raises(ValueError, match="in both"):
        PermissionScope(allowed_effects=(R, X), approval_effects=(X,))


def test_summary_shares_and_latency() -> None:
    base = {"e2e_s": 1.0, "tool_s": 0.5, "cost_usd": 0.1, "num_recoveries": 0, "num_duplicate_effects": 0,
            "num_possible_duplicate_effects": 1,
            "is_succeeded": False, "is_ended_by_budget": False, "is_ended_by_deadline": False,
            "is_ended_by_policy": False}
    rows = [{**base, "status": "succeeded", "is_succeeded": True, "num_recoveries": 2},
            {**base, "status": "ended_budget", "is_ended_by_budget": True, "e2e_s": 3.0},
            {**base, "status": "error", "num_recoveries": 1},
            {**base, "status": "running"}]
    s = summarize(rows)
    assert (s["num_tasks"], s["num_ended"], s["num_succeeded"]) == (4, 3, 1)
    assert (s["num_duplicate_effects"], s["num_possible_duplicate_effects"]) == (0, 4)
    assert s["share_ended_by_budget"] == pytest.approx(1 / 3)
    assert s["recovery_success_rate"] == pytest.approx(0.5)  # one of two recovered tasks ended well
    assert s["cost_per_successful_task_usd"] == pytest.approx(0.3)
    assert s["tool_wait_share"] == pytest.approx(1.5 / 5.0)
    assert _percentile([1.0, 2.0, 3.0, 4.0], 95) == pytest.approx(3.85)  # numpy's linear method


def _effect_row(key: str, command: str, effect: EffectClass, num_attempts: int, is_rerun: bool = False) -> dict:
    action = Action.build("terminal", {"command": command}, WS)
    return {"key": key, "effect": effect.value, "num_attempts": num_attempts,
            "intent": {"action": action.model_dump()}, "outcome": {"is_rerun": is_rerun}}


def _finished(key: str, num: int) -> list[dict]:
    return [{"kind": "tool_call", "payload": {"key": key}} for _ in range(num)]


SPEC = TaskSpec.model_validate({"task_id": "t", "problem_statement": "p", "workspace": str(WS),
                                "agent": {"base_url": "http://h/v1", "model": "m"}})
# (effect row, attempts that recorded an outcome, compensations of an in-doubt attempt) -> (known, possible)
DUPLICATES = [
    # the user's case, recorded before appends were local writes: run twice, the first in doubt
    (_effect_row("a", "echo one >> log.txt; sleep 8", I, 2), 1, 0, (0, 1)),
    (_effect_row("a", "echo one >> log.txt", L, 2), 1, 0, (0, 1)),
    (_effect_row("a", "echo one >> log.txt", L, 2), 2, 0, (1, 0)),  # both recorded: ran twice for sure
    (_effect_row("a", "echo one >> log.txt", L, 2, is_rerun=True), 1, 0, (0, 0)),  # a person approved
    (_effect_row("a", "echo one >> log.txt", L, 1), 0, 0, (0, 0)),  # in doubt, denied: not repeated
    (_effect_row("a", "git commit -qm x", C, 2), 1, 1, (0, 0)),  # undone before the re-run
    (_effect_row("a", "git commit -qm x", C, 2), 1, 0, (0, 1)),
    (_effect_row("a", "curl -X POST http://h/x", X, 3), 1, 0, (0, 2)),
    (_effect_row("a", "echo hi > out.txt", I, 2), 1, 0, (0, 0)),  # provably idempotent
    (_effect_row("a", "ls", R, 3), 3, 0, (0, 0)),
]


@pytest.mark.parametrize(("row", "num_finished", "num_undone", "expected"), DUPLICATES)
def test_duplicate_side_effects_known_and_possible(row: dict, num_finished: int, num_undone: int,
                                                   expected: tuple[int, int]) -> None:
    undone = [{"kind": "compensated", "payload": {"key": "a", "why": "in doubt after a restart"}}] * num_undone
    assert duplicate_effects([row], _finished("a", num_finished) + undone, SPEC) == expected


def test_recorded_classes_alone_miss_the_old_append() -> None:
    """Without the spec only the recorded class counts: the old row looked idempotent."""
    row = _effect_row("a", "echo one >> log.txt; sleep 8", I, 2)
    assert duplicate_effects([row], _finished("a", 1)) == (0, 0)
    assert duplicate_effects([row], _finished("a", 1), SPEC) == (0, 1)


# Files named by an option, an operand or a script rather than by a redirection: the guard and
# the task scope's paths must see them as any `> FILE`.
NAMED_OUTPUTS = [
    "uniq in {p}", "uniq -f 1 in {p}", "sort -o {p} f", "sort -ro {p} f", "sort --output={p} f",
    "curl -sSo {p} http://h/x", "curl --output {p} http://h/x", "wget -O {p} http://h/x",
    "cp -t {p} a b", "mv --target-directory={p} a", "cp -rt {p} a", "sed -n '1w {p}' f",
    "sed 's/a/b/w {p}' f", "sed -e 's/a/b/' -e 'w {p}' f", "awk '{{print > \"{p}\"}}' f",
    "find . -fprint {p}",
]


@pytest.mark.parametrize("template", NAMED_OUTPUTS)
def test_a_file_named_by_an_option_or_a_script_is_a_written_path(template: str) -> None:
    outside = check_command(template.format(p="/etc/x"), WS)
    assert not outside.is_allowed and outside.rule == "write_outside_workspace", template
    assert check_command(template.format(p="out/x"), WS).is_allowed
    effect = classify(Action.build("terminal", {"command": template.format(p="/etc/x")}, WS), WS)
    assert effect.effect == X and "/etc/x" in effect.written_paths


@pytest.mark.parametrize("command", [
    "uniq -c f", "sort -r f", "sed 's/w/x/' f", "sed '/w/d' f", "sed '1a w /etc/x' f",
    "sed --sandbox '1w /etc/x' f", "awk '$1 > 5' f", "cp -t out /etc/hosts", "wget -qO- http://h/x",
    "sed 's|/usr/|/opt/|g' f",
])
def test_text_that_only_looks_like_an_output_is_not_one(command: str) -> None:
    assert check_command(command, WS).is_allowed, command
