import { fmtInt, fmtRate, fmtSeconds } from "../../core/format";
import { turnStats, type AssistantTurn } from "./chatState";

export function MessageStats(props: { turn: AssistantTurn; testId?: string }) {
  const s = turnStats(props.turn);
  const items: [string, string, string][] = [
    ["TTFT", fmtSeconds(s.ttft), "time to first token"],
    ["speed", fmtRate(s.tokensPerS), "generated tokens per second of decoding"],
    ["prompt", fmtInt(s.promptTokens), "prompt tokens"],
    ["cached", fmtInt(s.cachedTokens), "prompt tokens served from the prefix cache"],
    ["generated", fmtInt(s.generated), "completion tokens (all choices)"],
    ["finish", s.finish ?? "–", "finish reason"],
  ];
  if (s.preemptions) items.push(["preempted", `×${s.preemptions}`, "times the request was preempted"]);
  if (s.queue !== null) items.push(["queued", fmtSeconds(s.queue), "time waiting before the first step"]);
  return (
    <dl className="stats" data-testid={props.testId ?? "message-stats"}>
      {items.map(([k, v, title]) => (
        <div key={k} title={title} data-stat={k}>
          <dt>{k}</dt>
          <dd>{v}</dd>
        </div>
      ))}
    </dl>
  );
}
